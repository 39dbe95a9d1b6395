"""The report's view of fault tolerance (``--ft-groups``): where one group's run spent its failures.

A replica group's run looks healthy in its loss curve even when groups died
around it: the batch is fixed and the result exact (docs/fault_tolerance.md).
What a failure costs is elsewhere, in fields every committed step of such a run
carries in ``metrics.jsonl``: ``quorum`` (the groups whose gradients the step
summed), ``attempts`` (more than 1: the step was redone), ``lost_s`` (seconds in
the failed attempts), ``quorum_s`` (seconds the committing attempt waited for its
quorum) and ``healed`` (this group received its state from a live peer), plus the
restart events its launcher wrote. This file turns them into one figure over
steps, the section's table and the summary table's row. A run whose steps carry
no ``quorum`` was not fault-tolerant and gets none of them.

Only observe's own inputs are read here (the closing table's line for the same
figures, ``ft/coordinator.QuorumCoordinator.summary_line``, lies above observe in the
layering).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .run_data import RunData  # noqa: E402

FIGURE = "fault_tolerance.png"
REDONE, HEALED, RESTART = "#e45756", "#54a24b", "#555555"


def ft_steps(run: RunData) -> list[dict]:
    """The committed steps that went through a quorum (empty: not a fault-tolerant run)."""
    return [m for m in run.metrics if isinstance(m.get("step"), int)
            and isinstance(m.get("quorum"), list)]


def _groups(run: RunData) -> int | None:
    n = run.config.get("ft_groups") or ((run.summary or {}).get("fault_tolerance") or {}).get(
        "groups")
    return int(n) if n else None


def _steps_text(steps: list[int]) -> str:
    """``4`` / ``4, 6`` / ``1-3, 7``: steps as a reader counts them."""
    spans: list[list[int]] = []
    for s in sorted(steps):
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def restart_steps(run: RunData, steps: list[dict]) -> list[int]:
    """For each restart, the first step the group committed after it (by wall clock).

    A restarted group continues from its checkpoint but heals from a live peer at
    its first quorum, so the step it came back at is where the restart shows, not
    the checkpoint's step. Without clocks: the step after the one it continued from.
    """
    out = []
    for e in (e for e in run.events if e.get("event") == "restart"):
        t = e.get("unix_time")
        timed = [m for m in steps if isinstance(m.get("unix_time"), (int, float))]
        if isinstance(t, (int, float)) and timed:
            after = [m["step"] for m in timed if m["unix_time"] > t]
            out.append(min(after) if after else steps[-1]["step"] + 1)
        else:
            out.append(int(e.get("step") or 0) + 1)
    return out


def ft_figure(run: RunData):
    """Quorum size per step with redone steps, heals and restarts marked; below, the seconds
    each step waited for its quorum and lost in failed attempts. (figure, caption) or None."""
    steps = ft_steps(run)
    if not steps:
        return None
    x = [m["step"] for m in steps]
    q = [len(m["quorum"]) for m in steps]
    groups = _groups(run)
    fig, (ax, tax) = plt.subplots(2, 1, figsize=(6.4, 4.6), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1.2]})
    ax.bar(x, q, width=0.8, color="#4c78a8", label="groups in the quorum")
    text = "Top, bars: how many replica groups' gradients each step summed (its quorum)."
    if groups:
        ax.axhline(groups, ls="--", color="gray", lw=1, label=f"all {groups} groups")
        text += f" Dashed: all {groups} groups of the run."
    redone = [(m["step"], len(m["quorum"]), m["attempts"]) for m in steps
              if (m.get("attempts") or 1) > 1]
    if redone:
        ax.plot([r[0] for r in redone], [r[1] + 0.3 for r in redone], "x", ms=8, mew=2,
                color=REDONE, label="redone")
        for s, h, n in redone:
            ax.text(s + 0.15, h + 0.3, f"{n} tries", fontsize=7, va="center", color=REDONE)
        text += (" Red crosses: steps redone after a failure, with the tries each took (the "
                 "failed tries' gradients were dropped and the same samples taken again).")
    healed = [(m["step"], len(m["quorum"])) for m in steps if m.get("healed")]
    if healed:
        ax.plot([h[0] for h in healed], [h[1] + 0.65 for h in healed], "^", ms=7,
                color=HEALED, label="healed")
        text += (" Green triangles: steps at which this group received the model, optimizer "
                 "and data position from a live peer (healed).")
    back = restart_steps(run, steps)
    most = max(q + [groups or 0])
    top = most + 1.6  # room above the bars for the marks and the legend
    for i, s in enumerate(sorted(set(back))):
        for a in (ax, tax):
            a.axvline(s - 0.5, color=RESTART, ls="-.", lw=1.2,
                      label="restart" if a is ax and i == 0 else None)
        n = back.count(s)  # left of the line, in the gap between bars
        ax.text(s - 0.55, 0.1, f"{n} restart{'s' * (n > 1)}", fontsize=7, rotation=90,
                ha="right", va="bottom", color=RESTART)
    if back:
        text += (" Dash-dotted lines: this group's workers restarted; each line stands before "
                 "the first step the group committed after the restart.")
    ax.set_ylim(0, top)
    ax.set_yticks(range(most + 1))
    ax.set(ylabel="groups in quorum", title="Fault tolerance: quorum per step")
    ax.legend(fontsize=7, loc="upper center", ncol=5, framealpha=1).set_zorder(5)
    text += _seconds_panel(tax, steps)
    tax.set(xlabel="step", ylabel="seconds")
    for a in (ax, tax):
        a.grid(alpha=0.3)
    return fig, text


def _seconds_panel(ax, steps: list[dict]) -> str:
    """Bottom panel: quorum waits and failed attempts' seconds, each only if recorded."""
    x = [m["step"] for m in steps]
    wait = [m.get("quorum_s") or 0.0 for m in steps]
    lost = [m.get("lost_s") or 0.0 for m in steps]
    text = ""
    if any(m.get("quorum_s") is not None for m in steps):
        ax.bar(x, wait, width=0.8, color="#72b7b2", label="waiting for the quorum")
        text += (" Bottom: the seconds each step's committing attempt waited for its quorum"
                 + (", with the seconds spent in its failed attempts stacked on top in red."
                    if any(lost) else "."))
    if any(lost):
        ax.bar(x, lost, bottom=wait, width=0.8, color=REDONE, label="failed attempts")
        if not text:
            text += " Bottom, red: the seconds each step spent in its failed attempts."
    if text:
        ax.legend(fontsize=7)
    return text


def ft_table(run: RunData) -> list[tuple[str, str]]:
    """The section's table: quorum sizes, redone steps, failed tries, heals, restarts, time."""
    steps = ft_steps(run)
    if not steps:
        return []
    groups = _groups(run)
    rows = []
    for size in sorted({len(m["quorum"]) for m in steps}, reverse=True):
        at = [m["step"] for m in steps if len(m["quorum"]) == size]
        of = f" of {groups}" if groups else ""
        rows.append((f"steps with {size}{of} group{'s' * (size != 1)} in the quorum",
                     f"{len(at)} (step{'s' * (len(at) > 1)} {_steps_text(at)})"))
    redone = [m for m in steps if (m.get("attempts") or 1) > 1]
    healed = [m["step"] for m in steps if m.get("healed")]
    back = restart_steps(run, steps)
    lost = sum(m.get("lost_s") or 0.0 for m in steps)
    rows += [("steps redone", f"{len(redone)}" + (f" (step{'s' * (len(redone) > 1)} "
                                                   f"{_steps_text([m['step'] for m in redone])})"
                                                   if redone else "")),
             ("failed attempts", str(sum(m["attempts"] - 1 for m in redone))),
             ("heals", f"{len(healed)}" + (f" (step{'s' * (len(healed) > 1)} "
                                           f"{_steps_text(healed)})" if healed else "")),
             ("restarts", f"{len(back)}" + (f" (back at step{'s' * (len(set(back)) > 1)} "
                                           f"{_steps_text(sorted(set(back)))})" if back else "")),
             ("seconds lost in failed attempts", f"{lost:.2f} s")]
    waits = [m for m in steps if m.get("quorum_s") is not None]
    if waits:
        top = max(waits, key=lambda m: m["quorum_s"])
        rows += [("longest quorum wait", f"{top['quorum_s']:.2f} s at step {top['step']}"),
                 ("seconds waiting for quorums",
                  f"{sum(m['quorum_s'] for m in waits):.2f} s over {len(waits)} steps")]
    return rows


def ft_summary_row(run: RunData) -> list[tuple[str, str]]:
    """The summary table's row, from summary.json's ``fault_tolerance`` (none without it)."""
    f = (run.summary or {}).get("fault_tolerance")
    if not isinstance(f, dict):
        return []
    sizes = f.get("steps_by_quorum_size") or {}
    by = ", ".join(f"{n} step{'s' * (n != 1)} on {q} group{'s' * (q != '1')}"
                   for q, n in sorted(sizes.items(), key=lambda kv: -int(kv[0])))
    heals, fails = f.get("heals", 0), f.get("failed_attempts", 0)
    return [("fault tolerance",
             f"group {f.get('group', '?')} of {f.get('groups', '?')}; steps by quorum size: "
             f"{by or '-'}; {f.get('redone_steps', 0)} redone "
             f"({fails} failed attempt{'s' * (fails != 1)}), {heals} "
             f"heal{'s' * (heals != 1)}, {f.get('lost_s', 0.0):.1f} s lost, "
             f"{f.get('quorum_s', 0.0):.1f} s waiting for quorums")]
