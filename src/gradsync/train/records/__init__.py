"""What a run tells while it runs and when it ends: measurements, display, trackers, summary.

``instrument.py`` measures each step (time blocked in collectives, bytes, peak memory:
carried in the step's one statistics gather), records the trace window and runs the
drift check; ``progress.py`` is rank 0's live display; ``trackers/`` sends every record
of ``metrics.jsonl`` through TensorBoard, CSV, W&B or MLflow as well (``--log``);
``callbacks.py`` the user's code at the loop's three moments (``gs.Callback``);
``summary.py`` the end of a run: ``summary.json``, the closing table, the report.
The records' files and their schema are ``gradsync.rundir``'s.
"""
