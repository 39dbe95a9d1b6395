"""The launching process: ``gs.train`` and ``gradsync train`` before any worker exists.

``api.py`` checks everything that can be checked before processes start (preflight),
takes the run directory's lock, launches the local workers and turns a worker's usage
error back into one line; ``gs.train`` is its Python door. Under ``torchrun`` there is
no launching process of ours: ``python -m gradsync.train`` (``train/__main__.py``) runs
the worker directly.
"""
