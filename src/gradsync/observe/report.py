"""`report.html`: one self-contained page about a run, plus its figures as PNG files.

Self-contained means it opens from a laptop's disk, attached to a ticket, on a
machine with no network: figures are inline base64 PNGs, the style and the one
small script are inline, nothing is fetched. The same PNGs are written beside the
page for slides and tickets. What the run did not produce (a cut-off run, no
trace, no planner) is stated on the page and returned in ``missing`` so the
CLI can print it too.
"""

from __future__ import annotations

import base64
import html
import os
import statistics
import time
from dataclasses import dataclass, field

from ..rundir import (
    REPORT,
    precision_text,
    strategy_text,
    sync_description,
    write_bytes,
    write_text,
)
from .balance_view import balance_rows
from .exactness import exactness_html, run_traffic_line
from .figures import Figure, make_figures
from .ft_view import FIGURE as FT_FIGURE
from .ft_view import ft_steps, ft_summary_row, ft_table
from .run_data import RunData, load_run
from .segments import segments, segments_text
from .timeline import StepTimeline, measured_step, predicted_step
from .traffic import size_text

STYLE = """body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:60rem;color:#222}
h1{font-size:1.5rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9rem}td,th{padding:.2rem .6rem;border:1px solid #ddd}
th{background:#f4f4f4;text-align:left}.ok{color:#1a7f37}.bad{color:#c62828;font-weight:bold}
.missing{background:#fff4e5;border:1px solid #f0c36d;padding:.5rem 1rem}
figure{margin:1rem 0}img{max-width:100%}figcaption{font-size:.85rem;color:#555}
.note{font-size:.85rem;color:#555}button{margin:.5rem 0}"""

SCRIPT = """(function(){var b=document.getElementById('toggle-steps');
var t=document.getElementById('steps');if(!b||!t)return;
b.addEventListener('click',function(){var h=t.style.display==='none';
t.style.display=h?'':'none';b.textContent=h?'Hide per-step table':'Show per-step table';});
})();"""


@dataclass
class ReportResult:
    html: str
    pngs: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def _e(x) -> str:
    return html.escape(str(x))


def _fmt(v, spec: str = ".4g") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def _table(rows: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>"
                               for k, v in rows) + "</table>"


def _key_numbers(run: RunData) -> list[tuple[str, str]]:
    c, s, m = run.config, run.summary or {}, run.metrics
    steady = m[min(3, len(m) - 1):] if m else []
    med = lambda k: statistics.median([r[k] for r in steady if r.get(k) is not None]) if any(  # noqa: E731
        r.get(k) is not None for r in steady) else None
    step_s = s.get("median_step_s") or med("step_time_s")
    exposed = med("exposed_comm_s")
    evals = [r for r in m if r.get("eval_loss") is not None]
    sizes = s.get("world_sizes") or c.get("world_sizes") or []
    workers = str(c.get("world_size", "?"))
    if len(sizes) > 1:
        workers += f" (over the run: {' -> '.join(map(str, sizes))})"
    rebuilt = " (summary.json rebuilt from metrics)" if s.get("rebuilt") else ""
    rows = [("status", ("finished" + rebuilt) if run.finished else "did not finish"),
            ("model / data", f"{c.get('model', '?')} / {c.get('data', '?')}"),
            ("strategy / precision / optimizer",
             f"{strategy_text(c)} / {precision_text(c)} / "
             f"{s.get('optimizer') or c.get('optimizer', '?')}"),
            ("synchronisation", sync_description(c, s.get("collectives"))),
            ("bytes sent (rank 0)", run_traffic_line(run)),
            ("seed", str(c.get("seed", "?"))),
            ("workers", workers),
            ("workers x accumulation x micro-batch",
             f"{c.get('world_size', '?')} x {c.get('accumulation', '?')} x "
             f"{c.get('micro_batch', '?')} = global batch {c.get('global_batch', '?')}"),
            ("steps completed", f"{m[-1]['step'] if m else 0} of {c.get('steps', '?')}"),
            ("final loss", _fmt(m[-1].get("loss")) if m else "-"),
            ("final held-out loss", _fmt(evals[-1]["eval_loss"]) if evals else
             "not evaluated" if not c.get("eval", True) else "-"),
            ("median step time", f"{step_s * 1e3:.1f} ms" if step_s else "-"),
            ("median exposed communication", f"{exposed * 1e3:.1f} ms" if exposed else "-"),
            ("samples / s (median step)", _fmt(med("samples_per_s"), ",.1f"))]
    if med("tokens_per_s"):
        rows.append(("tokens / s (median step)", _fmt(med("tokens_per_s"), ",.0f")))
    skipped = [r["step"] for r in m if r.get("skipped") and not r.get("overflow")]
    if skipped:
        rows.append(("steps skipped (NaN/inf)", ", ".join(map(str, skipped))))
    if any(r.get("loss_scale") for r in m):  # fp16 (engine/sync/loss_scale.py)
        n = sum(1 for r in m if r.get("overflow"))
        rows.append(("loss scaling (fp16)", f"{n} step{'s' * (n != 1)} skipped by loss scaling "
                     f"(last scale {m[-1].get('loss_scale') or 0:g})"))
    if s.get("resumed_from"):
        rows.append(("resumed from step", str(s["resumed_from"])))
    segs = segments(m, run.events)
    if len(segs) > 1:
        rows.append(("workers per stretch", segments_text(segs)))
    for e in (e for e in run.events if e.get("event") == "restart"):
        failed = e.get("failed") or [{}]
        who = (f"rank {failed[0]['rank']} {failed[0].get('how', 'failed')}" if "rank" in failed[0]
               else "workers restarted")
        rows.append((f"restart {e.get('attempt', '?')}",
                     f"{who}; continued from step {e.get('step', '?')}"))
    rows += ft_summary_row(run)
    rows += balance_rows(run)
    eff = s.get("scaling_efficiency") or med("scaling_efficiency")
    rows.append(("scaling efficiency vs 1 worker",
                 f"{eff:.0%}" if eff else "no baseline (run gradsync train --baseline)"))
    cap = s.get("bucket_cap_mb") or c.get("bucket_cap_mb") or c.get("bucket_mb")
    auto = " (auto-tuned)" if "auto" in (c.get("bucket_cap_mb"), c.get("bucket_mb")) else ""
    if c.get("strategy") == "zero3":
        rows.append(("gradient buckets", "one per wrapped unit (zero3)"))
    elif c.get("sync", "exact") != "exact":
        rows.append(("gradient buckets", "none: local updates all-reduce no gradients"))
    elif isinstance(cap, (int, float)):
        rows.append(("bucket cap", f"{_fmt(cap, '.3g')} MiB{auto}"))
    return rows


MEMORY_LABELS = (("params", "parameters"), ("grads", "gradients"),
                 ("master_params", "fp32 master weights"),
                 ("optimizer_state", "optimizer state (moments)"),
                 ("comm_buffers", "communication buffers"), ("padding", "shard padding"))
EXTRA_MEMORY = (("outer_copy", "outer copy (the global model DiLoCo keeps between syncs)"),
                ("residuals", "error-feedback residual (the compressor's)"))
"""Rows only a run of that kind has, shown where it has them (issue 37: an int8 run's
gradient-sized residual was nowhere, a DiLoCo run's outer copy was "fp32 master
weights")."""


def _memory_rows(mem: dict) -> list[tuple[str, str]]:
    def mib(key: str) -> str:  # exact bytes beside the unit: a small model's are not 0.00 MiB
        return size_text(int(mem.get(key) or 0))

    outer = mem.get("outer_copy") or 0
    rows = [("parameters", mib("params")), ("gradients", mib("grads"))]
    rows.append((EXTRA_MEMORY[0][1], mib("outer_copy")) if outer
                else ("fp32 master weights", mib("master_params")))
    rows.append(("optimizer state (moments)", mib("optimizer_state")))
    total = sum(mem.get(k) or 0 for k in ("params", "grads", "master_params", "outer_copy",
                                          "optimizer_state"))
    rows.append(("model state (the four above)", size_text(int(total))))
    rows.append(("communication buffers", mib("comm_buffers")))
    if mem.get("residuals"):
        rows.append((EXTRA_MEMORY[1][1], mib("residuals")))
    rows.append(("shard padding", mib("padding")))
    return rows


def _memory_html(run: RunData) -> str:
    mem = (run.summary or {}).get("memory")
    if not isinstance(mem, dict):
        return ""
    counts = [mem.get(k, 0) for k, _ in MEMORY_LABELS + EXTRA_MEMORY] + [mem.get("num_params", 0)]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in counts) \
            or not isinstance(mem.get("stage"), (int, type(None))):
        return ("<h2>Memory per rank</h2><p class='note'>summary.json's memory table is not "
                "as gradsync writes it (a field is not a number): not shown.</p>")
    stage = {0: "data parallel", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}.get(mem.get("stage"), "?")
    stage = {"diloco": "DiLoCo", "streaming-diloco": "streaming DiLoCo"}.get(
        mem.get("strategy") or "", stage)
    return (f"<h2>Memory per rank</h2><p class='note'>What one rank of {_e(mem.get('world'))} "
            f"held at the last step's fullest ({_e(stage)}; "
            f"{_e(format(mem.get('num_params', 0), ','))} parameters), counted from the tensors "
            "themselves.</p>" + _table(_memory_rows(mem)))


def _steps_table(run: RunData) -> str:
    cols = [("step", "d"), ("loss", ".4f"), ("eval_loss", ".4f"), ("lr", ".3g"),
            ("grad_norm", ".3g"), ("step_time_s", ".4f"), ("compute_s", ".4f"),
            ("exposed_comm_s", ".4f"), ("comm_bytes", ",d"), ("samples_per_s", ",.1f")]
    head = "".join(f"<th>{_e(c)}</th>" for c, _ in cols)
    body = "".join("<tr>" + "".join(f"<td>{_e(_fmt(m.get(c), f))}</td>" for c, f in cols)
                   + "</tr>" for m in run.metrics)
    return (f"<button id='toggle-steps' type='button'>Show per-step table</button>"
            f"<table id='steps' style='display:none'><tr>{head}</tr>{body}</table>")


TIMELINE = "timeline.png"
SECTION_FIGURES = (TIMELINE, FT_FIGURE)  # drawn in their own sections, not under the summary


def _figure_html(name: str, fig: Figure) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    return (f"<figure><img alt='{_e(name)}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{_e(fig.caption)} ({_e(name)})</figcaption></figure>")


def _timeline_html(run: RunData, figures: dict[str, Figure],
                   timelines: list[StepTimeline]) -> str:
    """The traced step, or how to get one: the section is there either way."""
    head = "<h2>Timeline of one step</h2>"
    if TIMELINE not in figures:
        why = ("trace.json holds no complete step" if run.trace is not None else
               "this run was not traced")
        return head + (f"<p class='note'>No timeline: {_e(why)}. <code>gradsync train "
                       "--trace</code> (or <code>--trace-steps FIRST:LAST</code>) records the "
                       "chosen steps on every rank into trace.json, and this section then "
                       "draws one of them next to the simulator's prediction.</p>")
    notes = "".join(f"<p class='note'>{_e(n)}</p>" for t in timelines for n in t.notes)
    return head + _figure_html(TIMELINE, figures[TIMELINE]) + notes


def _ft_html(run: RunData, figures: dict[str, Figure]) -> str:
    """Where a fault-tolerant group's run spent its failures; nothing for any other run."""
    if not ft_steps(run):
        return ""
    fig = _figure_html(FT_FIGURE, figures[FT_FIGURE]) if FT_FIGURE in figures else ""
    return ("<h2>Fault tolerance</h2><p class='note'>This group's view of the replica groups "
            "(--ft-groups): every step's gradient is the exact mean over the same global "
            "batch whatever the quorum; a failure costs redone steps, waits and restarts, "
            "counted here from metrics.jsonl.</p>" + fig + _table(ft_table(run)))


def render_page(run: RunData, figures: dict[str, Figure], timelines: list[StepTimeline],
                missing: list[str]) -> str:
    parts = [f"<h1>gradsync run report</h1><p class='note'>{_e(os.path.abspath(run.path))} "
             f"&middot; generated {_e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))}</p>"]
    if missing:
        parts.append("<div class='missing'><b>Missing from this run:</b><ul>" + "".join(
            f"<li>{_e(x)}</li>" for x in missing) + "</ul></div>")
    parts.append("<h2>Summary</h2>" + _table(_key_numbers(run)))
    parts += [_figure_html(name, fig) for name, fig in figures.items()
              if name not in SECTION_FIGURES]
    parts.append(_ft_html(run, figures))
    parts.append(_timeline_html(run, figures, timelines))
    parts.append(_memory_html(run))
    parts.append("<h2>Exactness and replica drift</h2>" + exactness_html(run))
    if run.metrics:
        parts.append("<h2>Per-step metrics</h2>" + _steps_table(run))
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<title>gradsync report</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}"
            f"<script>{SCRIPT}</script></body></html>")


_DAMAGE = (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError)
"""What reading a trace or a plan of the wrong shape raises: the file is not gradsync's."""


def _why(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:80]}"


def write_report(run_dir: str) -> ReportResult:
    """Write report.html and the PNGs into ``run_dir``; UsageError if it is not a run."""
    run = load_run(run_dir)
    missing = list(run.missing)
    measured = predicted = None
    if run.trace is not None:
        try:
            measured = measured_step(run.trace)
        except _DAMAGE as e:  # a trace.json of another program, or damaged: said, not raised
            missing.append(f"trace.json is not a trace gradsync wrote ({_why(e)}): no "
                           "measured timeline")
        else:
            if measured is None:
                missing.append("trace.json holds no complete step")
        if measured is not None and run.plan is not None:
            try:
                predicted = predicted_step(run.trace, run.plan,
                                           int(run.config.get("accumulation", 1)), measured.step)
            except _DAMAGE as e:
                missing.append(f"plan.json or trace.json is not as gradsync writes it "
                               f"({_why(e)}): no predicted timeline")
            else:
                if predicted is None:
                    missing.append("planner (gradsync.plan.simulate) not installed: "
                                   "no predicted timeline")
    figures = make_figures(run, measured, predicted)
    pngs = []
    for name, fig in figures.items():  # each atomic: a full disk leaves the old figure
        path = os.path.join(run_dir, name)
        write_bytes(path, fig.png, "a figure of the report")
        pngs.append(path)
    page = render_page(run, figures, [t for t in (measured, predicted) if t], missing)
    out = os.path.join(run_dir, REPORT)
    write_text(out, page, "the report")
    return ReportResult(out, pngs, missing)
