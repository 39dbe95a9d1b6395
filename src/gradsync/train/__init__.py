"""The training loop behind `gradsync train`; calling this package runs it.

``gradsync.train(config, model, data)`` is :func:`gradsync.train.launcher.api.train`. The
name is both this package and that function: importing the package makes
``gradsync.train`` refer to it, so the package itself is made callable and
forwards to the function (and stays cheap to import: nothing is loaded until
the call).
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from .launcher.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
