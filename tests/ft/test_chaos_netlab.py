"""Chaos on emulated hosts: 12 faults, the uninterrupted run's model, every sample used.

Three replica groups, one per emulated host (netlab, 100 Mbit/s links), torchft's
lighthouse on a fourth; a seeded schedule SIGKILLs 6 workers, kills 4 whole hosts
(every process in the namespace; a replacement starts a second later and resumes
from the group's checkpoint) and partitions 2 hosts for 8 s (longer than the
5 s collective timeout, so the others drop the group and it heals once back).
Faults on different groups overlap. The groups end with the parameters of one
uninterrupted `gradsync train` on the whole batch (float64 SGD with momentum,
1e-12), having read every sample of the uninterrupted run and no other, with no
hang (every wait bounded) and no namespace left behind; no live group was left
out of a step (``gradsync.ft.membership``: a group missing from a step was down
for it). The same at steps of 2 s, for 30 minutes: ``test_soak.py``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from gradsync.ft.membership import Watcher, down_windows, job_steps, summary
from gradsync.netlab import Netlab, chaos, leftovers, unavailable_reason
from gradsync.netlab.groups import GroupsLab

from .helpers import TRAIN, env, max_diff, recorded, run_train

# About 100 s alone and 120-140 s inside the suite: more than the CI's 20-minute
# budget has left, so the CI skips it; `GRADSYNC_SOAK=1 python -m pytest
# tests/ft/test_chaos_netlab.py` runs it (docs/fault_tolerance.md says what CI runs).
pytestmark = [pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=str(unavailable_reason())),
              pytest.mark.skipif(os.environ.get("GRADSYNC_SOAK") != "1",
                                 reason="the chaos soak runs with GRADSYNC_SOAK=1")]

STEPS = 300
ARGS = ["--model", "tests.train.factories:slow64", "--steps", str(STEPS),
        "--checkpoint-every", "20"]


@pytest.mark.timeout(420)
def test_twelve_faults_on_emulated_hosts_leave_the_uninterrupted_model(tmp_path):
    proc, straight_record = run_train([*ARGS, "--workers", "1", "--out",
                                       str(tmp_path / "straight")], tmp_path,
                                      GRADSYNC_TEST_FORWARD_S="0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    straight = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["model"]

    throttle = tmp_path / "forward_s"
    throttle.write_text("0.03")  # steps slow enough for 12 faults; 0 once they are done
    record = tmp_path / "record-chaos"
    record.mkdir()
    extra = {k: v for k, v in env(record).items() if k.startswith(("GRADSYNC_", "PYTHONPATH"))}
    extra["GRADSYNC_TEST_FORWARD_FILE"] = str(throttle)
    faults = chaos.plan(seed=7, groups=3, first_step=4, last_step=110, workers=6, hosts=4,
                        partitions=2)
    out = tmp_path / "job"
    t0 = time.monotonic()
    with Netlab(hosts=4, rate="100mbit") as lab:
        prefix = lab.prefix
        groups = GroupsLab(lab, [*TRAIN, *ARGS], 3, str(out), env=extra).start()
        watcher = Watcher(str(out), 3, every_s=0.2).start()
        fired: list = []

        def unleash():
            fired.extend(chaos.unleash(groups, faults))
            throttle.write_text("0")

        thread = threading.Thread(target=unleash, daemon=True)
        thread.start()
        codes = groups.wait(STEPS, timeout=330)
        thread.join(timeout=30)
        groups.stop()
        rows = watcher.stop()
    took = time.monotonic() - t0
    assert not [ns for ns in leftovers() if ns.startswith(prefix)]
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(out.glob("host-*.log")))
    assert len(fired) == 12 and all(f.done for f in fired), (fired, logs)
    assert sorted(f.fault.kind for f in fired).count("host") == 4
    assert codes.count(0) >= 2, (codes, took, logs)  # a group hit last may be stopped late
    windows = down_windows(rows, 3, [f.window() for f in fired])
    for w in windows:
        w.end += 0.2  # a step's recorded start may trail the quorum it began with
    counts = summary(job_steps(rows, 3), 3, windows)
    assert counts["left_out_live"] == 0 and not counts["disagree"], counts

    finished = [g for g in range(3) if codes[g] == 0]
    for g in finished:
        ckpt = torch.load(out / f"group-{g}" / "checkpoint.pt", weights_only=False)
        assert ckpt["step"] == STEPS
        assert max_diff(ckpt["model"], straight) <= 1e-12, g
    expected, read = recorded(straight_record), recorded(record)
    assert set(read) == set(expected)  # no sample outside the run's order
    assert all(read[i] >= n for i, n in expected.items())  # none skipped
    heals = sum(p.read_text().count("healed at step") for p in out.glob("host-*.log"))
    # groups came back by healing from a live peer (fewer heals than faults: a fault
    # may hit a group again before it healed, or while no quorum could form)
    assert heals >= 4, heals
    print(f"12 faults in {took:.0f} s, {heals} heals, {counts}: " + "; ".join(
        f"{f.fault.kind} g{f.fault.group} @{f.job_step} ({f.t_s:.0f} s)" for f in fired))
