"""Goodput through failures at steps of 2 s: torchrun's restart-from-checkpoint against the quorum.

    sudo .venv/bin/python benchmarks/fault_tolerance.py                  # ~30 min here
    sudo .venv/bin/python benchmarks/fault_tolerance.py --quick          # ~8 min, to see it work

Three emulated hosts (netlab, ``--rate`` links each way), one worker each, the
built-in GPT whose every forward first sleeps ``--forward-s`` (1.5 s:
``fault_tolerance_model.py``), so a step lasts about 2 s, the regime of issue 35
(with the old 1 s join timeout every step there was a heal); for each failure
rate (``--per-minute``, default 0, 1 and 4 a minute) two jobs of ``--duration``
seconds each, one after the other:

* ``restart``: today's answer, one torchrun job across the three hosts with
  ``--max-restarts``; a failure stops every worker, the job re-rendezvouses and
  resumes from the last checkpoint (``--checkpoint-every``), recomputing the
  steps since;
* ``quorum``: three replica groups (``gradsync netlab run --ft-groups 3``'s
  layout: one group per host, torchft's lighthouse on a fourth with the settings
  ``gradsync lighthouse`` derives); a failure costs the survivors the step in
  flight, and the restarted group heals from a peer.

Failures are SIGKILLs of one worker, on a random host, evenly spaced from 5 s
into the window (``netlab/chaos.py``'s ``at_rate``; the same times and hosts for
both jobs).
Measured per job, over ``--duration`` seconds from its first committed step (the
start-up is the same for both and reported apart): **goodput**, the samples of
the steps committed in that window per second (steps since the last checkpoint
count for ``restart`` too, though its next failure would lose them); the median
**step** time; for ``quorum``, from every group's committed rows as the job ran
(``gradsync.ft.membership``), **heals per step** and **groups left out per step**,
all of them and those left out while alive (outside their failure's own steps:
the quorum must make this 0), and per failure the **pause** -- the survivors'
longest wait between committed steps after the kill, beyond a step -- and
**back** -- kill to the restarted group's first committed step -- beside the state
a heal transfers (the size of a group's checkpoint) and its transfer time at the
link rate; for ``restart``, kill to the job's next committed step. Results go to
``--out`` (``results.json``, ``table.txt``) with the command, commit, date and
load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gradsync.ft import membership  # noqa: E402
from gradsync.netlab import Netlab, chaos  # noqa: E402
from gradsync.netlab.groups import GroupsLab  # noqa: E402
from gradsync.plan.units import parse_rate  # noqa: E402
from gradsync.rundir import METRICS, read_metrics  # noqa: E402

GROUPS = 3
TRAIN = ["--model", "fault_tolerance_model:slow_gpt", "--data", "pysrc", "--steps", "100000",
         "--global-batch", "12", "--micro-batch", "4", "--eval-every", "0", "--no-report",
         "--drift-every", "0", "--timeout", "120"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=240.0, help="seconds per job")
    p.add_argument("--forward-s", type=float, default=1.5,
                   help="each forward's added seconds (steps of about 2 s with the GPT's own)")
    p.add_argument("--per-minute", default="0,1,4", help="failure rates, comma-separated")
    p.add_argument("--rate", default="100mbit", help="each host link's rate")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps (restart resumes)")
    p.add_argument("--seed", type=int, default=0, help="the failures' hosts")
    p.add_argument("--out", default="benchmarks/results/fault_tolerance")
    p.add_argument("--quick", action="store_true", help="--duration 100 --per-minute 0,4")
    a = p.parse_args(argv)
    if a.quick:
        a.duration, a.per_minute = 100.0, "0,4"
    return a


class RestartJob:
    """One torchrun job across the hosts, as the chaos harness sees a GroupsLab."""

    def __init__(self, lab, out: str, extra: list[str], env: dict):
        self.lab, self.out, self.groups = lab, out, lab.num_hosts
        self.procs = {}
        for h in lab.hosts:
            argv = lab.torchrun_argv(h, 1, ["-m", "gradsync.train", *TRAIN, *extra,
                                            "--out", out])
            argv[argv.index("--max-restarts") + 1] = "1000"
            self.procs[h.index] = lab.popen(h, argv, env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)

    def last_committed(self, g: int = 0) -> int:
        rows = read_metrics(os.path.join(self.out, METRICS))[0]
        return max((r["step"] for r in rows if "loss" in r), default=0)

    def kill_worker(self, g: int, pick: int = 0) -> int | None:
        return GroupsLab.kill_worker(self, g, pick)

    def worker_pids(self, g: int) -> list[int]:
        return GroupsLab.worker_pids(self, g)

    def stop(self) -> None:
        from gradsync.netlab.processes import terminate

        for p in self.procs.values():
            terminate(p)


def rows_of(path: str) -> list[dict]:
    return [r for r in read_metrics(path)[0] if "loss" in r and "unix_time" in r]


def _longest_gap(times: list[float], k: float, until: float) -> float:
    """The longest wait between committed steps (or from the kill) in ``[k, until]``: the
    step the failure interrupted, redone."""
    ts = [k] + [t for t in times if k < t <= until]
    return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)


def _job_commits(rows: dict[int, list[dict]]) -> list[float]:
    """When the job committed each step: the earliest group's record of it. One group's
    file alone misses steps: a restarted group resumes its checkpoint and cuts the
    rows after it (they are redone by healing), survivors' rows included."""
    first: dict[int, float] = {}
    for rs in rows.values():
        for r in rs:
            first[r["step"]] = min(first.get(r["step"], r["unix_time"]), r["unix_time"])
    return sorted(first.values())


def run_job(method: str, per_minute: float, args, out: Path) -> dict:
    """One job of ``args.duration`` seconds under ``per_minute`` worker kills."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    faults = chaos.at_rate(args.seed, GROUPS, per_minute, args.duration, start_s=5.0)
    env = {"PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT / 'benchmarks'}",
           "GRADSYNC_BENCH_FORWARD_S": str(args.forward_s)}
    extra = ["--checkpoint-every", str(args.checkpoint_every)]
    watcher = None
    with Netlab(GROUPS + (method == "quorum"), args.rate) as lab:
        if method == "quorum":
            job = GroupsLab(lab, [*TRAIN, *extra], GROUPS, str(out), env=env,
                            max_restarts=1000).start()
            watcher = membership.Watcher(str(out), GROUPS).start()
        else:  # torch 2.13's rendezvous needs this to restart a multi-node job (README)
            job = RestartJob(lab, str(out / "run"), extra,
                             {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        t_launch = time.time()
        while job.last_committed(0) < 1 and time.time() - t_launch < 300:
            time.sleep(0.1)  # the clock starts at the first committed step: no start-up
        start = time.time()
        first_step = max(job.last_committed(g) for g in range(GROUPS))
        fired: list = []
        stop = threading.Event()
        thread = threading.Thread(target=lambda: fired.extend(chaos.unleash(job, faults, stop)),
                                  daemon=True)
        thread.start()
        time.sleep(args.duration)
        end = time.time()
        stop.set()
        committed = max(0, max(job.last_committed(g) for g in range(GROUPS)) - first_step)
        thread.join(timeout=30)
        job.stop()
        kept = watcher.stop() if watcher else None
    dirs = ([out / f"group-{g}" for g in range(GROUPS)] if method == "quorum"
            else [out / "run"])
    rows = {i: rows_of(str(d / METRICS)) for i, d in enumerate(dirs)}
    members = None
    if kept is not None:  # every row the job committed, restarts' cuts included
        rows = {g: [r for r in kept[g].rows if "unix_time" in r] for g in range(GROUPS)}
        window = [s for s in membership.job_steps(kept, GROUPS) if start <= s.committed <= end]
        members = membership.summary(window, GROUPS, membership.down_windows(
            kept, GROUPS, [f.window() for f in fired]))
    step_times = [b["unix_time"] - a["unix_time"] for rs in rows.values()
                  for a, b in zip(rs, rs[1:]) if b["step"] == a["step"] + 1]
    step_s = statistics.median(step_times) if step_times else 0.0
    pauses, backs, training, never = [], [], [], 0
    commits = _job_commits(rows)
    kills = [f.unix for f in fired]
    for i, (f, k) in enumerate(zip(fired, kills)):
        # a failure's pause ends at the next failure (the next one's is its own), 30 s at most
        until = min(end, k + 30.0, *kills[i + 1:i + 2])
        if method == "quorum":  # what the failure cost the survivors: the job's longest
            pauses.append(_longest_gap(commits, k, until) - step_s)  # wait beyond a step
            after = [r["unix_time"] for r in rows[f.fault.group] if r["unix_time"] > k]
        else:  # every worker restarts: kill to the job's next committed step
            after = [r["unix_time"] for r in rows[0] if r["unix_time"] > k]
        if after:
            (backs if method == "quorum" else pauses).append(min(after) - k)
        if after and method == "quorum":  # healed and training: that step's start
            first = next(r for r in rows[f.fault.group] if r["unix_time"] == min(after))
            training.append(first["unix_time"] - first["step_time_s"] - k)
        never += not after
    ckpt = dirs[0] / "checkpoint.pt"
    return {"method": method, "per_minute": per_minute, "duration_s": round(end - start, 1),
            "start_up_s": round(start - t_launch, 1), "failures": len(fired),
            "committed_steps": committed, "goodput": committed * 12 / (end - start),
            "pause_s": pauses, "back_s": backs, "training_again_s": training,
            "never_back": never, "step_s": step_s, "fired_s": [round(k - start, 2) for k in kills],
            "state_bytes": ckpt.stat().st_size if ckpt.exists() else None,
            "membership": members, "load_at_end": os.getloadavg()[0]}


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} s, {max(xs):.1f} s" if xs else "-"


def _per_step(m: dict | None, key: str) -> str:
    return f"{m[key] / m['steps']:.2f} ({m[key]})" if m and m["steps"] else "-"


def render(results: list[dict], args) -> Table:
    """step: the median committed step's time. heals/step and left out/step (quorum):
    per committed step in the window (in brackets, the count); left out, all groups
    missing from a step, and alive, those missing outside their failure's own steps.
    pause: quorum, the survivors' longest wait between committed steps after a kill
    beyond a step's time; restart, kill to the job's next committed step. training
    again: kill to the start of the restarted group's first step (healed: state
    received and loaded); first commit: kill to the end of that step. never back:
    kills after which the window saw no committed step of the victim (quorum) or the
    job (restart)."""
    free = {r["method"]: r["goodput"] for r in results if r["per_minute"] == 0}
    rate = parse_rate(args.rate, "--rate")
    t = Table(title=f"goodput through failures: 3 emulated hosts at {args.rate}, built-in GPT "
                    f"+ {args.forward_s:g} s a forward, {args.duration:.0f} s per job")
    for col in ("method", "failures/min", "fired", "step", "committed steps",
                "goodput (samples/s)", "of its failure-free", "heals/step", "left out/step",
                "alive left out/step", "pause (median, max)", "training again (median, max)",
                "first commit (median, max)", "never back", "state, at link rate"):
        t.add_column(col, justify="right")
    for r in results:
        share = r["goodput"] / free[r["method"]] if free.get(r["method"]) else None
        state = (f"{r['state_bytes'] / 1e6:.1f} MB, {r['state_bytes'] / rate:.1f} s"
                 if r["state_bytes"] else "-")
        m = r.get("membership")
        quorum = r["method"] == "quorum"
        t.add_row(r["method"], f"{r['per_minute']:g}", str(r["failures"]), f"{r['step_s']:.2f} s",
                  str(r["committed_steps"]), f"{r['goodput']:.2f}",
                  f"{share:.0%}" if share else "-", _per_step(m, "heals"),
                  _per_step(m, "missing"), _per_step(m, "left_out_live"),
                  _spread(r["pause_s"]),
                  _spread(r.get("training_again_s") or []) if quorum else "(all restart)",
                  _spread(r["back_s"]) if quorum else "(all restart)",
                  str(r["never_back"]), state)
    return t


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for per_minute in [float(x) for x in args.per_minute.split(",")]:
        for method in ("restart", "quorum"):  # alternating, the same failure times
            print(f"{method}, {per_minute:g} failures a minute ...", flush=True)
            results.append(run_job(method, per_minute, args,
                                   out / "runs" / f"{method}-{per_minute:g}-per-minute"))
            print(json.dumps(results[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    meta = {"command": " ".join(["benchmarks/fault_tolerance.py", *(argv or sys.argv[1:])]),
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_end": os.getloadavg(), "cores": os.cpu_count()}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    console = Console(width=220, record=True)
    console.print(render(results, args))
    loads = [r["load_at_end"] for r in results]
    console.print(f"{meta['command']} at {commit}, {meta['date']}, load average at each job's end "
                  f"{min(loads):.1f}-{max(loads):.1f}")
    (out / "table.txt").write_text(console.export_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
