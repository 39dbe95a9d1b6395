"""One step as lanes of spans: measured (from trace.json) and predicted (simulator).

The point of putting them side by side (a run is planned before it runs and
visible while it runs): where the measurement departs from the prediction is
where the model of the machine is wrong -- a slower link than calibrated, backward not
overlapping, a rank waiting for another. The prediction is computed for the
*same* run: the planner's ``simulate_step`` is fed a profile taken from the traced
step itself (forward, backward and optimizer times; alpha from the header
all-reduce or, where the item count rides in the first bucket, the per-step
statistics gather; beta from the buckets' service times) and the run's own parameters
and bucket caps, so it answers "what should this step have looked like".
The planner is optional here: without ``gradsync.plan.simulate`` there is simply
no prediction.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Lane:
    label: str
    spans: list[tuple[float, float, str, str]] = field(default_factory=list)  # t0, t1, name, cat


@dataclass
class StepTimeline:
    title: str
    step: int | None
    step_s: float
    lanes: list[Lane]
    notes: list[str] = field(default_factory=list)


def _x_events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def traced_steps(trace: dict) -> list[int]:
    return sorted({int(e["args"]["step"]) for e in _x_events(trace) if e.get("cat") == "step"})


def measured_step(trace: dict, step: int | None = None) -> StepTimeline | None:
    """The last traced step (steady state), lanes per rank; times from rank 0's step start."""
    steps = traced_steps(trace)
    if not steps:
        return None
    step = steps[-1] if step is None else step
    evs = [e for e in _x_events(trace) if e.get("args", {}).get("step") == step]
    starts = [e for e in evs if e["cat"] == "step"]
    if not starts:
        return None
    origin = min(e["ts"] for e in starts)
    step_end = max(e["ts"] + e["dur"] for e in starts)
    lanes = []
    for rank in sorted({e["pid"] for e in evs}):
        compute, comm = Lane(f"rank {rank} compute"), Lane(f"rank {rank} comm")
        for e in sorted(evs, key=lambda e: e["ts"]):
            if e["pid"] != rank or e["cat"] == "step":
                continue
            span = ((e["ts"] - origin) / 1e6, (e["ts"] + e["dur"] - origin) / 1e6,
                    e["name"], e["cat"])
            (comm if e["cat"] == "comm" else compute).spans.append(span)
        lanes += [compute, comm]
    return StepTimeline(f"measured: step {step}", step, (step_end - origin) / 1e6, lanes)


def _rank0(trace: dict, step: int, name_prefix: str) -> list[dict]:
    return [e for e in _x_events(trace) if e["pid"] == 0 and e["name"].startswith(name_prefix)
            and e.get("args", {}).get("step") == step]


def measured_profile(trace: dict, plan: dict, step: int):
    """A planner StepProfile from rank 0's traced ``step`` (ImportError without the planner)."""
    from ..plan.profile import ParamProfile, StepProfile

    dur = lambda evs: [e["dur"] / 1e6 for e in evs]  # noqa: E731
    fwd = dur(_rank0(trace, step, "forward"))
    bwd_all = _rank0(trace, step, "backward")
    local = [e for e in bwd_all if not e["args"].get("sync")]
    if local:
        bwd = statistics.median(dur(local))
    else:
        waits = sum(dur(_rank0(trace, step, "sync wait")))
        bwd = max(0.0, sum(dur(bwd_all)) - waits)
    opt = sum(dur(_rank0(trace, step, "optimizer")))
    all_steps = traced_steps(trace)
    headers = [d for s in all_steps for d in dur(_rank0(trace, s, "all_reduce header"))]
    # fp32/fp64 models carry the item count inside the first bucket, so there may be
    # no header: then the quickest per-step statistics gather (a few bytes) is alpha.
    stats = [d for s in all_steps for d in dur(_rank0(trace, s, "all_gather stats"))]
    alpha = statistics.median(headers) if headers else min(stats) if stats else 6e-4
    world = int(plan.get("world_size", 2))
    betas = []
    for s in all_steps:
        prev_end = 0.0
        for e in sorted(_rank0(trace, s, "all_reduce bucket"), key=lambda e: e["ts"]):
            start, end = e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6
            service = end - max(start, prev_end)  # time it had the link to itself
            prev_end = end
            volume = 2 * (world - 1) / world * e["args"].get("bytes", 0)
            if volume > 0 and service > alpha:
                betas.append((service - alpha) / volume)
    beta = statistics.median(betas) if betas else 1 / 0.75e9
    params = plan["params"]
    total = sum(p[1] for p in params) or 1
    profile = StepProfile(
        forward_s=statistics.median(fwd) if fwd else 0.0,
        params=tuple(ParamProfile(name, numel, itemsize, bwd * numel / total, dtype)
                     for name, numel, itemsize, dtype in params),
        optimizer_s=opt, alpha_s=alpha, beta_s_per_byte=beta, world_size=world)
    return profile


def predicted_step(trace: dict, plan: dict, accumulation: int, step: int) -> StepTimeline | None:
    """The simulator's version of ``step``, or None where the planner is not installed."""
    try:
        from ..plan.simulate import simulate_step
    except ImportError:
        return None
    profile = measured_profile(trace, plan, step)
    res = simulate_step(profile, plan["bucket_cap_mb"], plan["first_bucket_mb"], accumulation)
    compute, comm = Lane("predicted compute"), Lane("predicted comm")
    micro = profile.forward_s + profile.backward_s
    for k in range(accumulation):
        t = k * micro
        compute.spans.append((t, t + profile.forward_s, "forward", "compute"))
        end = res.backward_end_s if k == accumulation - 1 else t + micro
        compute.spans.append((t + profile.forward_s, end, "backward", "compute"))
    comm_end = max([b.end_s for b in res.buckets], default=res.backward_end_s)
    if comm_end > res.backward_end_s:
        compute.spans.append((res.backward_end_s, comm_end, "sync wait", "wait"))
    compute.spans.append((res.step_s - res.optimizer_s, res.step_s, "optimizer", "compute"))
    for b in res.buckets:
        comm.spans.append((b.start_s, b.end_s, f"all_reduce bucket{b.index}", "comm"))
    notes = [f"profile from the traced step: forward {profile.forward_s * 1e3:.1f} ms, "
             f"backward {profile.backward_s * 1e3:.1f} ms per micro-step, optimizer "
             f"{profile.optimizer_s * 1e3:.1f} ms, alpha {profile.alpha_s * 1e3:.2f} ms, "
             f"bandwidth {1 / profile.beta_s_per_byte / 1e9:.2f} GB/s",
             f"predicted step {res.step_s * 1e3:.1f} ms, exposed communication "
             f"{res.exposed_s * 1e3:.1f} ms, {len(res.buckets)} bucket(s) "
             f"(the run used {len(plan.get('buckets', []))})"]
    return StepTimeline(f"predicted (gradsync.plan.simulate): step {step}", step, res.step_s,
                        [compute, comm], notes)
