"""`--log tensorboard,csv,wandb,mlflow` through a REAL run stopped every way a run stops.

One run directory, one command, four launches of a real ``gradsync train`` process
(its own session, signals sent as a terminal or a scheduler sends them):

1. Ctrl-C (SIGINT to the process group) while W&B's run folder is being made, before
   any checkpoint: the next attempt is a fresh start;
2. Ctrl-C between two checkpoints;
3. SIGTERM to the launcher alone (a scheduler's stop);
4. a worker failure (rank 0 raises), after which the workers restart and finish.

Then every tracker is read back with its own reader -- W&B's offline ``.wandb`` logs
through ``wandb-core leet inspect --json`` (the reader W&B ships), MLflow's client on
the file store, tensorboard's ``EventAccumulator``, the csv module -- and must hold
every step once, equal to ``metrics.jsonl``; W&B and MLflow hold one run, marked
killed or failed by each stopped attempt and finished by the last (issue 37, point 1).
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

import gradsync
from gradsync.rundir import METRICS, METRICS_CSV, TRACKERS, read_metrics_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the gradsync these tests import (a checkout's src/ ahead of an installed copy elsewhere)
SRC = os.path.dirname(os.path.dirname(os.path.abspath(gradsync.__file__)))
LOG = "tensorboard,csv,wandb,mlflow"
STEPS = 40
ARGS = ["train", "--workers", "2", "--steps", str(STEPS), "--global-batch", "8",
        "--micro-batch", "4", "--lr", "0.05", "--warmup", "2", "--optimizer", "sgd",
        "--checkpoint-every", "5", "--eval-every", "5", "--drift-every", "0", "--no-report",
        "--timeout", "60", "--log", LOG, "--model", "tests.train.factories:slow64",
        "--data", "tests.train.factories:regression64"]


def _as_from_a_terminal():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _reached(out, since: float) -> int:
    """The last step metrics.jsonl holds that was trained after ``since`` (this attempt's:
    until the attempt cuts the file back, it holds the last one's steps)."""
    try:
        lines = (out / METRICS).read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec.get("step"), int) and rec.get("unix_time", 0) >= since:
            steps.append(rec["step"])
    return max(steps)


def _trackers_open(out) -> bool:
    """Every tracker of the attempt running now is open: MLflow, which opens last, has
    marked the run RUNNING (the attempt before ended it KILLED, FAILED or FINISHED)."""
    from mlflow.tracking import MlflowClient

    try:
        run_id = json.loads((out / TRACKERS).read_text())["mlflow"]["run_id"]
        client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
        return client.get_run(run_id).info.status == "RUNNING"
    except Exception:  # noqa: BLE001 - not written yet, or mid-write: not open yet
        return False


def _attempt(out, env, until=None, send=None, to_group=True, extra=(), pace=None):
    """One attempt of the command: ``until(out)`` true, then ``send`` (a signal) to the
    process group (a terminal's Ctrl-C) or to the launcher alone; the exit code and
    stderr.

    ``pace``: the file ``slow64``'s forward reads its delay from. The trackers open on
    their own thread while the workers train; an attempt that ended before W&B had opened
    left no W&B run (by design: the next attempt sends it those steps), so the test saw
    one exit record fewer when a loaded machine opened them late (CI). With ``pace``, the
    steps go slowly until every tracker is open, then at the test's speed."""
    since = time.time()
    if pace is not None:
        pace.write_text("2")  # seconds a forward: the trackers open long before step 33
    command = [sys.executable, "-m", "gradsync.cli", *ARGS, *extra, "--out", str(out)]
    proc = subprocess.Popen(command,
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:
        deadline = time.monotonic() + 120
        speed = env["GRADSYNC_TEST_FORWARD_S"]
        moments = [] if pace is None else [(lambda o, t: _trackers_open(o),
                                            lambda: pace.write_text(speed))]
        if until is not None:
            moments.append((until, lambda: os.killpg(proc.pid, send) if to_group
                            else os.kill(proc.pid, send)))
        for moment, act in moments:
            while not moment(out, since):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the moment never came"
                time.sleep(0.02)
            act()
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    for pkg in ("tensorboard", "wandb", "mlflow"):
        pytest.importorskip(pkg)
    base = tmp_path_factory.mktemp("stopped")
    out = base / "run"
    env = {k: v for k, v in os.environ.items()
           if k not in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI",
                        "MLFLOW_EXPERIMENT_NAME", "GRADSYNC_FAULT")}
    env.update({k: str(base / "wandb-home") for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR",
                                                      "WANDB_DATA_DIR")},
               GRADSYNC_TEST_FORWARD_S="0.02", PYTHONPATH=os.pathsep.join([ROOT, SRC]))
    codes = []
    pace = base / "forward-seconds"
    paced = {**env, "GRADSYNC_TEST_FORWARD_FILE": str(pace)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store too
        # 1. Ctrl-C while W&B makes its run folder, steps of 10 s: no checkpoint yet
        pace.write_text("10")
        codes.append(_attempt(out, paced, lambda o, t: (o / "wandb").is_dir(), signal.SIGINT))
        assert not (out / "checkpoint.pt").exists()  # the next attempt starts afresh
        # 2. Ctrl-C between the checkpoints of steps 10 and 15
        codes.append(_attempt(out, paced, lambda o, t: _reached(o, t) >= 12, signal.SIGINT,
                              pace=pace))
        # 3. a scheduler's SIGTERM to the launcher alone
        codes.append(_attempt(out, paced, lambda o, t: _reached(o, t) >= 23, signal.SIGTERM,
                              to_group=False, pace=pace))
        # 4. a worker fails (rank 0, whose trackers these are, raises in step 33), the
        # workers restart and finish
        codes.append(_attempt(out, {**paced, "GRADSYNC_FAULT": "0:33:raise"},
                              extra=("--max-restarts", "1"), pace=pace))
    assert [c for c, _ in codes] == [130, 130, 130, 0], codes
    metrics = read_metrics_file(str(out / METRICS))
    assert [r["step"] for r in metrics.records] == list(range(1, STEPS + 1))
    return out, {r["step"]: r for r in metrics.records}, [e for _, e in codes]


def _scalars(rec: dict) -> dict:
    from gradsync.train.records.trackers.base import scalars

    return scalars(rec)


def _same(a: float, b: float, rel: float = 0.0) -> bool:
    return a == b or math.isclose(a, b, rel_tol=rel)


def _wandb_inspect(path: str) -> list[dict]:
    """A ``.wandb`` log's records, read by W&B's own reader (the wandb-core binary)."""
    from wandb.util import get_core_path

    r = subprocess.run([get_core_path(), "leet", "inspect", "-json", "-no-observability",
                        "-run-file", path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


def test_wandb_holds_every_step_once_in_one_run(run):
    out, records, errs = run
    run_id = json.loads((out / TRACKERS).read_text())["wandb"]["run_id"]
    folders = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    steps, exits, ids = [], [], set()
    for folder in folders:
        files = glob.glob(os.path.join(folder, "run-*.wandb"))
        assert len(files) == 1, folder
        held = []
        for rec in _wandb_inspect(files[0]):
            if rec["type"] == "run":
                ids.add(rec["run"]["run_id"])
            elif rec["type"] == "exit":
                exits.append(rec["exit"].get("exit_code", 0))
            elif rec["type"] == "history":
                item = rec["history"]["item"]
                step = int(rec["history"]["step"]["num"])
                held.append(step)
                want = _scalars(records[step])
                got = {k: v for k, v in item.items() if not k.startswith("_")}
                assert set(got) == set(want), (step, set(got) ^ set(want))
                assert all(_same(got[k], want[k]) for k in want), step
        assert held, f"{folder} holds no step: wandb sync would upload it as an empty run"
        steps += held
    assert ids == {run_id}  # one run: the attempt before the first checkpoint left nothing
    assert steps == list(range(1, STEPS + 1))  # each step once, in order, across the folders
    # each attempt that held a step ended with its exit record: Ctrl-C, SIGTERM, failed, done
    assert exits == [130, 143, 1, 0] and len(folders) == 4, (exits, folders, errs[1:])


def test_mlflow_holds_every_step_once_and_one_finished_run(run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out, records, _ = run
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("gradsync")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["lr"] == "0.05"
    run_id = runs[0].info.run_id
    assert json.loads((out / TRACKERS).read_text())["mlflow"]["run_id"] == run_id
    keys = sorted({k for r in records.values() for k in _scalars(r)})
    for key in keys:
        hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        want = [(s, _scalars(r)[key]) for s, r in sorted(records.items()) if key in _scalars(r)]
        assert [s for s, _ in hist] == [s for s, _ in want], key
        assert all(_same(a, b) for (_, a), (_, b) in zip(hist, want)), key


def test_tensorboard_holds_every_step_once(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, records, _ = run
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    keys = sorted({k for r in records.values() for k in _scalars(r)})
    assert sorted(acc.Tags()["scalars"]) == keys
    for key in keys:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = [(s, _scalars(r)[key]) for s, r in sorted(records.items()) if key in _scalars(r)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert all(_same(a, b, 1e-6) for (_, a), (_, b) in zip(got, want)), key


def test_csv_holds_every_step_once(run):
    out, records, _ = run
    with open(out / METRICS_CSV, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        want = _scalars(records[int(row["step"])])
        assert all(_same(float(row[k]), v) for k, v in want.items()), row["step"]
