"""``--trace`` and ``--trace-steps``: which steps a run traces, checked before it starts."""

from __future__ import annotations

from ...errors import UsageError


def traced_steps(trace: bool, trace_steps: str, steps: int) -> tuple[int, int] | None:
    """The traced steps (1-based, inclusive), or None: ``--trace-steps`` FIRST:LAST or one
    step, within ``steps``; with ``--trace`` alone, steps 3 to 5 clipped to the run."""
    if not trace:
        return None
    if not trace_steps:
        first = min(3, steps)
        return first, min(first + 2, steps)
    text = trace_steps.strip()
    parts = text.split(":")
    try:
        if len(parts) == 1:
            first = last = int(parts[0])
        elif len(parts) == 2:
            first, last = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise UsageError(f"--trace-steps must be FIRST:LAST or one step number, "
                         f"got {trace_steps!r}") from None
    if first < 1 or last < first:
        raise UsageError(f"--trace-steps {text}: need 1 <= FIRST <= LAST")
    if last > steps:
        raise UsageError(f"--trace-steps {text} goes beyond the last step (--steps "
                         f"{steps}); choose a window within 1:{steps}")
    return first, last
