"""``--log mlflow``: an MLflow run in a file store, ``RUN/mlruns`` (``mlflow ui
--backend-store-uri RUN/mlruns``), through ``MlflowClient``.

The file store is what ``mlflow-skinny`` (the lean package: the tracking client,
no server, no SQL) can write; MLflow 3 keeps it in maintenance mode and refuses it
unless ``MLFLOW_ALLOW_FILE_STORE`` is set, which this tracker sets for its own
process when the user has not. ``MLFLOW_TRACKING_URI``, when set, is used
instead (a server or a database of the user's). Experiment
``$MLFLOW_EXPERIMENT_NAME`` or ``gradsync``; the run is named after its
directory, its parameters are the run's flags (logged when the run is created:
MLflow refuses to change a parameter), and gradsync's run id is a tag. The
MLflow run id is kept in ``trackers.json``, so a resume continues the same run.
A run that ended before its last step is marked KILLED; the resume sets it
RUNNING again.
"""

from __future__ import annotations

import os
import pathlib
import time

from ....rundir import MLFLOW_DIR
from .base import Start, Tracker

MAX_PARAM = 500  # characters of a flag's value kept as a parameter


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, start: Start):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        server = os.environ.get("MLFLOW_TRACKING_URI") or None  # None: RUN/mlruns
        uri = server or pathlib.Path(start.out, MLFLOW_DIR).resolve().as_uri()
        self.client = client = MlflowClient(tracking_uri=uri)
        saved = start.saved or {}
        run_id = saved.get("run_id") if saved.get("server") == server else None
        if run_id and self._exists(run_id):  # (a moved run directory keeps its store)
            client.update_run(run_id, status="RUNNING")
            self.through = start.reached
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "gradsync"
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else client.create_experiment(name)
            run_id = client.create_run(exp_id, run_name=start.name,
                                       tags={"gradsync.run_id": start.run_id}).info.run_id
            params = [Param(k, str(v)[:MAX_PARAM]) for k, v in sorted(start.config.items())]
            for i in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
                client.log_batch(run_id, params=params[i:i + 100])
            self.through = 0
        self.run_id = run_id
        self.state = {"run_id": run_id, "server": server}

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
            return True
        except MlflowException:
            return False

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        from mlflow.entities import Metric

        ms = int(1000 * (record.get("unix_time") or time.time()))
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step)
                                                    for k, v in values.items()])

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


def open_tracker(start: Start) -> Tracker:
    return MlflowTracker(start)
