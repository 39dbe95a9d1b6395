"""The launching process: ``gs.train`` and ``gradsync train`` before any worker exists.

``preflight.py`` checks everything that can be checked before processes start, takes
the run directory's lock and decides fresh, continue or finished; ``api.py`` is
``gs.train``, the Python door, and :func:`~gradsync.train.launcher.api.launch_workers`,
which starts the local workers and turns a worker's usage error back into one line
(``cli/train.py`` is the command line's door to the same two). Under ``torchrun`` there
is no launching process of ours: ``python -m gradsync.train`` (``train/__main__.py``)
runs the worker directly, and rank 0 makes the directory's checks (``worker/setup.py``).
``evaluate.py`` is ``gs.evaluate`` (``gradsync eval``): a checkpoint verified, its workers
launched to score it (``worker/evaluate.py``), the run directory only read.
"""
