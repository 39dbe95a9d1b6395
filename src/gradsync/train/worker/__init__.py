"""One worker's part of a run, start to end: set up, run the steps, finish.

``setup.py`` builds this rank's session (run directory, lock, resume decision -- rank
0's, broadcast so every rank acts alike --, task, strategy, restored state);
``loop.py`` runs the steps and what comes between them (plan, drift check, checkpoint,
callbacks, a clean stop) and is the entry every launcher calls, :func:`run_worker`;
``faults.py`` is the fault injector the loop is handed for tests of recovery;
``evaluate.py`` is a worker of ``gradsync eval``: a checkpoint's model scored by the loop's
own held-out evaluation.
"""
