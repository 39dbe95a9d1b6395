"""Live recovery: a restarted group heals from a peer, even when killed mid-transfer,
and a dead lighthouse that comes back costs a pause, not the run.

* two groups of two workers (a quorum needs both groups; the batch of 10 deals
  3/3/2/2 over the four ranks, and each rank sends half the gradient across
  groups); rank 1 of group 1 SIGKILLed during step 4, the group restarted by its
  launcher, SIGKILLed again the moment rank 1 has received its peer's state
  (before loading it), restarted again: it heals, and both groups end at the
  uninterrupted model (1e-12) while group 0 waited without restarting;
* the cluster form (torchft's own `torchft_lighthouse`, one `gradsync train
  --ft-group i` per group): the lighthouse SIGKILLed after step 3 and started again
  on the same address two seconds later; both groups continue and end at the same
  model.
"""

import shutil
import socket
import subprocess
import sys
import time

from gradsync.ft.lighthouse import settings_for
from gradsync.rundir import METRICS, read_metrics

from .helpers import ROOT, TRAIN, env, final_model, max_diff, restarts, run_train, step_rows


def test_a_group_killed_while_receiving_state_heals_on_its_next_start(tmp_path, straight):
    model, _ = straight
    out = tmp_path / "ft"
    proc, _ = run_train(["--workers", "2", "--ft-groups", "2", "--max-restarts", "2",
                         "--out", str(out)], tmp_path,
                        GRADSYNC_FT_FAULT="1/1:3:kill,1/1:3:kill-in-heal@1")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "injected fault kill-in-heal on rank 1 at step 4 (attempt 1" in text
    for g in (0, 1):
        assert max_diff(final_model(out / f"group-{g}"), model) <= 1e-12, g
    assert not restarts(out / "group-0")
    assert [r["step"] for r in step_rows(out / "group-0")] == list(range(1, 9))
    assert len(restarts(out / "group-1")) == 2
    healed = [r for r in step_rows(out / "group-1") if r.get("healed")]
    assert healed and healed[0]["step"] == 4, healed
    assert all(r["quorum"] == [0, 1] for r in step_rows(out / "group-1"))
    assert "[group 1] gradsync train: healed at step 4" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lighthouse(port: int) -> subprocess.Popen:
    binary = shutil.which("torchft_lighthouse", path=str(__import__("pathlib").Path(
        sys.executable).parent))
    assert binary, "torchft_lighthouse is installed with torchft"
    settings = settings_for(2, 60)  # the cluster form's lighthouse: gradsync lighthouse --print
    return subprocess.Popen([binary, *settings.argv(f"127.0.0.1:{port}")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


FORWARD_S = "0.4"
"""Each step's forward takes this long, so the 5 steps after step 3 outlast the moment
it takes to see step 3 and kill the lighthouse (with no delay a fast machine finished
all 8 steps first, and no quorum waited)."""


def test_the_lighthouse_killed_and_restarted_costs_a_pause(tmp_path, straight):
    model, _ = straight
    port = _free_port()
    light = _lighthouse(port)
    groups = []
    try:
        for g in (0, 1):
            cmd = [sys.executable, "-m", "gradsync", "train", *TRAIN, "--workers", "1",
                   "--ft-groups", "2", "--ft-group", str(g), "--ft-lighthouse",
                   f"127.0.0.1:{port}", "--out", str(tmp_path / f"group-{g}")]
            groups.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                           env=env(GRADSYNC_TEST_FORWARD_S=FORWARD_S)))
        metrics = tmp_path / "group-0" / METRICS
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the lighthouse dies once step 3 is done
            if metrics.exists() and any(r.get("step", 0) >= 3 and "loss" in r
                                        for r in read_metrics(str(metrics))[0]):
                break
            time.sleep(0.05)
        light.kill()
        light.wait()
        done = max(r.get("step", 0) for r in read_metrics(str(metrics))[0] if "loss" in r)
        assert done < 8, f"both groups finished before the lighthouse died (step {done})"
        time.sleep(2)
        light = _lighthouse(port)
        outs = [p.communicate(timeout=180)[0] for p in groups]
    finally:
        for p in groups:
            if p.poll() is None:
                p.kill()
        light.kill()
    assert [p.returncode for p in groups] == [0, 0], "\n".join(o[-3000:] for o in outs)
    for g in (0, 1):
        run = tmp_path / f"group-{g}"
        assert max_diff(final_model(run), model) <= 1e-12, g
        assert [r["step"] for r in step_rows(run)] == list(range(1, 9))
        waited = max(r["quorum_s"] for r in step_rows(run))
        assert 1.5 < waited < 30, (g, waited)  # the pause: the lighthouse's absence, bounded
