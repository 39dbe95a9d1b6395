"""The built-in learning-rate schedule, and what happens to it when a run is continued.

A schedule is planned over a number of steps (``--schedule-steps``, by default the
``--steps`` of the run's first launch) and that plan is part of the run: it is
recorded in every checkpoint (``schedule_steps`` in its config) and a continued
run keeps it. Continuing a finished run with a larger ``--steps`` therefore does
not re-plan the cosine over the new length -- which made the rate jump back up
(issue 22: from 3.7e-4 to 2.6e-3 at step 31) -- the planned decay has already
ended, and the steps past the plan train at the schedule's final rate: 10% of
``--lr`` for cosine, ``--lr`` for constant. Why the final rate rather than, say,
a second cosine: it is what the schedule says for every step after its end, so a
run continued in pieces trains exactly like one launched for the whole length
with the same ``--schedule-steps``, and nothing ever jumps. Re-planning over the
new ``--steps`` is a change of the run's schedule, asked for explicitly with
``--override schedule-steps`` (``train/checkpoint/identity.py``).
"""

from __future__ import annotations

import math

COSINE_FLOOR = 0.1  # cosine decays to this fraction of --lr


def planned_steps(cfg) -> int:
    """The steps a fresh run plans its schedule over (``--schedule-steps``, else ``--steps``).

    A continued run keeps the plan its checkpoint records instead
    (``config.plan.RunPlan.schedule_steps``, which the session's schedule and a
    ``--scheduler`` factory's ``total_steps`` are given).
    """
    return cfg.optim.schedule_steps or cfg.run.steps


def lr_factor(step: int, cfg, planned: int | None = None) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak (or the peak, constant),
    over ``planned`` steps (default: :func:`planned_steps`, a fresh run's plan); past
    the plan, the final factor. ``cfg``: a resolved ``RunConfig``."""
    if step < cfg.optim.warmup:
        return (step + 1) / cfg.optim.warmup
    if cfg.optim.schedule == "constant":
        return 1.0
    span = max(1, (planned or planned_steps(cfg)) - cfg.optim.warmup)
    progress = min(1.0, (step - cfg.optim.warmup) / span)
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


def describe(cfg, planned: int) -> str:
    """The schedule in words, e.g. "warm-up 20, cosine to 3e-04 over 300 steps"."""
    if cfg.optim.scheduler:
        return f"--scheduler {cfg.optim.scheduler} over {planned} steps"
    shape = ("constant" if cfg.optim.schedule == "constant"
             else f"cosine to {COSINE_FLOOR * cfg.optim.lr:.2g}")
    warm = f"warm-up {cfg.optim.warmup}, " if cfg.optim.warmup else ""
    return f"{warm}{shape} over {planned} steps"


def _final_rate(cfg) -> str:
    if cfg.optim.scheduler:
        return "the rate its --scheduler gives past its total_steps"
    factor = 1.0 if cfg.optim.schedule == "constant" else COSINE_FLOOR
    return f"its final rate, {factor * cfg.optim.lr:.2g}"


def past_plan_note(cfg, planned: int) -> str | None:
    """What a run continued beyond its planned schedule does, or None if it stays within."""
    if cfg.run.steps <= planned:
        return None
    return (f"the learning-rate schedule keeps its plan ({describe(cfg, planned)}): steps "
            f"{planned + 1}-{cfg.run.steps} train at {_final_rate(cfg)}; to plan it over "
            f"{cfg.run.steps} steps instead, add --override schedule-steps")


def finished_line(cfg, step: int, planned: int, notes=()) -> str:
    """``gradsync train``'s line for a run directory whose run is already finished
    (``notes``: the plan's, which say where an early stop ended it)."""
    if notes and step < cfg.run.steps:
        return (f"gradsync train: {cfg.run.out} already finished: {'; '.join(notes)}; "
                "nothing to do")
    return (f"gradsync train: {cfg.run.out} already finished (step {step} of {cfg.run.steps}); "
            f"nothing to do. A larger --steps continues it: its learning-rate schedule keeps "
            f"its plan ({describe(cfg, planned)}), so the extra steps train at "
            f"{_final_rate(cfg)} (--override schedule-steps plans it over the new --steps "
            "instead)")
