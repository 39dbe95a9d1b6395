"""The report's "Exactness and replica drift" section: what this run's sync mode guarantees.

Three modes, three different promises (``sync_mode.py``), and the page states the
one this run made, with its numbers -- never the exact mode's sentence for a run
that was not exact:

* exact: each step's gradient is the mean over every item of the global batch;
* compressed: the compressor, its measured ratio to the exact all-reduce's
  bytes, and the probed cosine and relative error against the exact gradient;
* local updates: replicas differ between syncs by design and are identical
  after each sync, where the drift check runs.

The drift line gives the true reason when no check result exists (off, not
applicable, stopped before the first check, or lost).
"""

from __future__ import annotations

import html

from ..rundir import sync_description
from .run_data import RunData
from .sync_mode import (
    COMPRESSED,
    LOCAL,
    compressor_text,
    first_drift_check,
    sync_mode,
    sync_schedule,
)
from .traffic import gradient_bytes, run_traffic, traffic_line


def _e(x) -> str:
    return html.escape(str(x))


def run_traffic_line(run: RunData) -> str:
    sizes = gradient_bytes(run.summary, run.plan)
    return traffic_line(run_traffic(run.metrics, sizes), run.config.get("strategy", ""))


def probe_text(run: RunData) -> str:
    """The distance of the compressed gradient from the exact one, as numbers."""
    probed = [m for m in run.metrics if m.get("grad_cosine") is not None]
    every = run.config.get("probe_every")
    if not probed:
        return ("Distance from exact: not measured (--probe-every 0)." if every == 0 else
                "Distance from exact: no step was probed yet (the first probe is the first "
                "compressed step, then every --probe-every steps).")
    cos = [m["grad_cosine"] for m in probed]
    err = [m["grad_rel_error"] for m in probed if m.get("grad_rel_error") is not None]
    text = (f"Distance from exact, probed on step{'s' * (len(probed) > 1)} "
            f"{', '.join(str(m['step']) for m in probed)} (--probe-every {every}): "
            f"cosine with the exact gradient {cos[-1]:.6f} at the last probe, lowest "
            f"{min(cos):.6f}")
    if err:
        text += (f"; relative error |compressed - exact| / |exact| {err[-1]:.3g} at the last "
                 f"probe, highest {max(err):.3g}")
    return text + "."


def gradients_html(run: RunData, mode: str) -> str:
    c = run.config
    items = sorted({m.get("items") for m in run.metrics if m.get("items") is not None})
    sent = f"Bytes sent by rank 0: {run_traffic_line(run)}."
    if mode == COMPRESSED:
        return (f"<p><b>Gradients: not exact, by design</b> (--compress {_e(c['compress'])}): "
                f"every bucket is summed through a compressor, "
                f"{_e(compressor_text(c['compress']))}. The first synchronised window is "
                "all-reduced exactly; every later one travels compressed, so each update is "
                "close to, not equal to, the mean over every item of the global batch. "
                f"{_e(sent)}</p><p>{_e(probe_text(run))}</p>")
    if mode == LOCAL:
        streaming = c.get("sync") == "streaming-diloco"
        when = ("Each of the fragments syncs at its own step, every H steps, overlapped with "
                "the next local steps and merged with the local copy, so the replicas agree "
                "only after the final sync, at the end of the run."
                if streaming else
                "Every H steps the workers sync: their item-weighted pseudo-gradients are "
                "summed and one outer step, the same on every worker, makes the replicas "
                "identical again; the run ends with a sync.")
        how = sync_description(c, (run.summary or {}).get("collectives")).removesuffix(
            " (not exact)")
        return (f"<p><b>Gradients: local updates, not exact by design</b> ({_e(how)}). "
                "Each worker steps on the exact mean over its own items only, so between "
                "syncs the replicas differ by design. "
                f"{_e(when)} {_e(sent)}</p>")
    return ("<p><b>Gradients: exact.</b> Each step's gradient is the exact mean over every "
            "item of the global batch (<code>backward(loss, num_items=n)</code>, summed then "
            f"divided by the global count); items per step: "
            f"{_e(', '.join(map(str, items)) or '-')}. {_e(sent)}</p>")


def _not_run(run: RunData, mode: str) -> str:
    """Why there is no drift result, in the run's own terms."""
    c, m = run.config, run.metrics
    last = m[-1].get("step", 0) if m else 0
    first = first_drift_check(c)
    if mode == LOCAL and first is None and run.summary is None:
        return (f"not run: streaming DiLoCo replicas agree only after the final sync, and this "
                f"run stopped at step {last} of {c.get('steps', '?')}")
    if first is not None and last < first and run.summary is None:
        where = (f"before its first sync (step {first}), where local-update replicas are "
                 "checked") if mode == LOCAL else f"before the first check (step {first})"
        return f"not run: this run stopped at step {last}, {where}"
    return (f"no result: drift.json is absent, though this run reached step {last} and a "
            "check was due (it may have been deleted)")


def drift_html(run: RunData, mode: str) -> str:
    d, c = run.drift, run.config
    if c.get("strategy") == "zero3":
        return ("<p class='note'>Drift check: not applicable (ZeRO-3: every rank holds a "
                "different shard of the parameters).</p>")
    if not c.get("drift_every", 1) and d is None:
        return "<p class='note'>Drift check: off (--drift-every 0).</p>"
    if d is None:
        return f"<p class='note'>Drift check: {_e(_not_run(run, mode))}.</p>"
    if not d.get("ok", True):
        return (f"<p class='bad'>Drift check FAILED at step {_e(d.get('last_step'))}: "
                f"{_e(d.get('error', 'replicas differ'))}</p>")
    text = drift_text(d, c, run.metrics)
    return f"<p class='ok'>Drift check: {_e(text)}.</p>"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _at(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:10])) + (f", ... ({len(steps) - 10} more)"
                                               if len(steps) > 10 else "")
    return f"step{'s' * (len(steps) != 1)} {shown}"


def sync_steps(config: dict, metrics: list[dict]) -> list[int]:
    """The steps a DiLoCo run synced at (after its synchronous warm-up): those after which
    every worker held one model (``one_model`` in metrics.jsonl), the run's end included."""
    warmup = int(config.get("sync_warmup") or 0)
    return [m["step"] for m in metrics if m.get("one_model") and m.get("step", 0) > warmup]


def drift_text(drift: dict, config: dict, metrics: list[dict], short: bool = False) -> str:
    """A passed drift check in words, counted from drift.json and metrics.jsonl: how many
    checks, where, and -- for DiLoCo, checked after some of its syncs -- after how many of
    them. ``short``: the closing table's line. Issue 37: "replicas identical (1 checks)",
    and "after each sync (2 checks)" after 4 syncs."""
    n = int(drift.get("checks") or 0)
    checked = [s for s in drift.get("steps") or [] if isinstance(s, int)]
    checks = _count(n, "check")
    every, at = drift.get("every"), drift.get("at", "steps")
    how = (f"last at step {drift.get('last_step')}; {drift.get('params', '?')} parameter "
           "tensors, bit-exact checksums")
    where = f" at {_at(checked)}" if checked and len(checked) == n else ""
    if at == "end":
        return (f"replicas identical after the final sync ({checks})" if short else
                f"replicas identical after the final sync ({checks}; {how})")
    if at == "syncs":
        syncs = sync_steps(config, metrics)
        after = "a sync or a synchronous warm-up step" if config.get("sync_warmup") else "a sync"
        if short:
            if syncs and n < len(syncs):
                return (f"replicas identical in {checks}, after {n} of the run's "
                        f"{_count(len(syncs), 'sync')}")
            return f"replicas identical after every sync ({checks})"
        ran = (f"; the run synced {_count(len(syncs), 'time')}, at {_at(syncs)}" if syncs
               else "")
        return (f"replicas identical in {'all ' if n != 1 else ''}{checks}{where}, each right "
                f"after {after} ({sync_schedule(config)}{ran}; checked at the first, then at "
                f"the first at least {every} steps after the last check, and at the end); "
                f"{how}")
    if short:
        return f"replicas identical ({checks})"
    return (f"replicas identical in {'all ' if n != 1 else ''}{checks}{where} (every "
            f"{every} steps and at the end; {how})")


def exactness_html(run: RunData) -> str:
    mode = sync_mode(run.config)
    return gradients_html(run, mode) + drift_html(run, mode)
