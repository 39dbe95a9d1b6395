"""The training loop behind `gradsync train`; calling this package runs it.

``gradsync.train(config, model, data)`` is :func:`gradsync.train.launcher.api.train`.
The name is both this package and that function: importing the package makes
``gradsync.train`` refer to it, so the package itself is made callable and
forwards to the function (and stays cheap to import: nothing is loaded until
the call). ``python -m gradsync.train`` (``__main__.py``) is the worker's entry
under torchrun.

The rooms, one idea each (each folder's ``__init__`` says what its files hold;
docs/architecture.md follows a run through them):

* ``config/``: what the run is asked to do -- ``TrainConfig``, its flags, every
  flag check;
* ``launcher/``: the launching process, before any worker exists -- preflight (the
  checks, the run directory's lock, the resume decision), ``gs.train``, the local
  workers;
* ``worker/``: one worker's part, start to end -- ``setup`` builds the
  ``Session``, the loop runs the steps and what comes between them;
* ``step/``: one optimizer step, exact over the global batch, and the held-out
  evaluation;
* ``task/``: what is trained -- model, data, loss and items, optimizer, schedule;
* ``checkpoint/``: what a run keeps on disk to continue (format, unit, save/load,
  identity, the directory's guard, size, restarts) and what comes out (export);
* ``records/``: what a run tells -- measurements, trace, drift, display, trackers,
  callbacks, the summary.

Outside this package: the quorum's side of the step (its coordinator) is
``ft/quorum_step.py`` and ``ft/local_groups.py``, ``gradsync verify --model`` is
``checks/exactness.py`` (the built-in check on the user's own workload), the command
line is ``cli/train.py`` (``cli/train_group.py`` for a replica group on one machine).
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from .launcher.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
