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
MLflow run id is kept in ``trackers.json``, so a resume continues the same run,
after reading back the last step it holds (its ``items`` history: written last of
each step). The history cannot be cut back, so this tracker gets a step only once
a checkpoint holds it (``base.py``). An attempt ends the run FINISHED, KILLED (a
Ctrl-C, SIGTERM or a clean stop; the resume sets it RUNNING again) or FAILED (a
worker failure).

A run this attempt created and sent no step is deleted when it closes (MLflow's
delete: restorable, hidden from searches), and a fresh start deletes the run of
the earlier attempts in this directory's own store (no checkpoint continues it):
the experiment holds the run the directory holds, once.
"""

from __future__ import annotations

import os
import pathlib
import time

from ....rundir import MLFLOW_DIR
from .base import FAILED, FINISHED, HELD_KEY, KILLED, Outcome, Start, Tracker

MAX_PARAM = 500  # characters of a flag's value kept as a parameter
STATUS = {FINISHED: "FINISHED", KILLED: "KILLED", FAILED: "FAILED"}


class MlflowTracker(Tracker):
    name = "mlflow"
    cuts_back = False

    def __init__(self, start: Start):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        server = os.environ.get("MLFLOW_TRACKING_URI") or None  # None: RUN/mlruns
        uri = server or pathlib.Path(start.out, MLFLOW_DIR).resolve().as_uri()
        self.client = client = MlflowClient(tracking_uri=uri)
        saved = start.saved or {}
        earlier = saved.get("run_id") if saved.get("server") == server else None
        earlier = earlier if earlier and self._exists(earlier) else None
        self.created = not (start.resumed and earlier)
        if not self.created:  # (a moved run directory keeps its store)
            client.update_run(earlier, status="RUNNING")
            self.run_id, self.through = earlier, self._held(earlier)
        else:
            if earlier and server is None:  # a fresh start replaces what no checkpoint kept
                client.delete_run(earlier)
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "gradsync"
            exp = client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else client.create_experiment(name)
            self.run_id = client.create_run(exp_id, run_name=start.name,
                                            tags={"gradsync.run_id": start.run_id}).info.run_id
            params = [Param(k, str(v)[:MAX_PARAM]) for k, v in sorted(start.config.items())]
            for i in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
                client.log_batch(self.run_id, params=params[i:i + 100])
            self.through = 0
        self.state = {"run_id": self.run_id, "server": server}

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _held(self, run_id: str) -> int:
        """The last step the run holds whole (its ``items``, logged last of each step)."""
        return max((m.step for m in self.client.get_metric_history(run_id, HELD_KEY)),
                   default=0)

    def log(self, step: int, values: dict[str, float], record: dict) -> None:
        from mlflow.entities import Metric

        ms = int(1000 * (record.get("unix_time") or time.time()))
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, ms, step)
                                                    for k, v in values.items()])

    def close(self, outcome: Outcome) -> None:
        if self.created and not self.sent and outcome.status != FINISHED:
            self.client.delete_run(self.run_id)  # began here, holds nothing: no extra run
            return
        self.client.set_terminated(self.run_id, STATUS[outcome.status])


def open_tracker(start: Start) -> Tracker:
    return MlflowTracker(start)
