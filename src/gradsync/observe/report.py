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

from ..rundir import REPORT, sync_description, write_bytes, write_text
from .balance_view import CAPTION as BALANCE_CAPTION
from .balance_view import balance_rows
from .figures import make_figures
from .run_data import RunData, load_run
from .timeline import StepTimeline, measured_step, predicted_step

CAPTIONS = {
    "loss.png": "Loss: the exact mean over every item of the global batch, per step (dots: "
                "the held-out loss, exact over the whole held-out set); below, the learning "
                "rate each step used.",
    "throughput.png": "Throughput per step; dashed: K times the 1-worker baseline "
                      "(perfect scaling), when the run had --baseline.",
    "step_breakdown.png": "Rank 0's step time split into compute (communication hidden "
                          "behind backward counts here) and exposed communication: time blocked "
                          "waiting on collectives.",
    "balance.png": BALANCE_CAPTION,
    "timeline.png": "One traced step, every rank, next to the simulator's prediction for the "
                    "same bucket plan (when the planner is installed).",
    "memory.png": "Peak memory per rank over the run.",
    "communication.png": "Bytes rank 0 communicated per step; with --compress, on probed "
                         "steps, how far the compressed gradient was from the exact one "
                         "(cosine and relative error). --sync exact with no compression is "
                         "exact by construction.",
}

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
             f"{c.get('strategy', 'ddp')} / {c.get('precision', 'fp32')} / "
             f"{s.get('optimizer') or c.get('optimizer', '?')}"),
            ("synchronisation", sync_description(c)),
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
    skipped = [r["step"] for r in m if r.get("skipped")]
    if skipped:
        rows.append(("steps skipped (NaN/inf)", ", ".join(map(str, skipped))))
    if s.get("resumed_from"):
        rows.append(("resumed from step", str(s["resumed_from"])))
    for e in (e for e in run.events if e.get("event") == "restart"):
        failed = e.get("failed") or [{}]
        who = (f"rank {failed[0]['rank']} {failed[0].get('how', 'failed')}" if "rank" in failed[0]
               else "workers restarted")
        rows.append((f"restart {e.get('attempt', '?')}",
                     f"{who}; continued from step {e.get('step', '?')}"))
    rows += balance_rows(run)
    eff = s.get("scaling_efficiency") or med("scaling_efficiency")
    rows.append(("scaling efficiency vs 1 worker",
                 f"{eff:.0%}" if eff else "no baseline (run gradsync train --baseline)"))
    cap = s.get("bucket_cap_mb") or c.get("bucket_cap_mb") or c.get("bucket_mb")
    auto = " (auto-tuned)" if "auto" in (c.get("bucket_cap_mb"), c.get("bucket_mb")) else ""
    if c.get("strategy") == "zero3":
        rows.append(("gradient buckets", "one per wrapped unit (zero3)"))
    elif isinstance(cap, (int, float)):
        rows.append(("bucket cap", f"{_fmt(cap, '.3g')} MiB{auto}"))
    return rows


MEMORY_LABELS = (("params", "parameters"), ("grads", "gradients"),
                 ("master_params", "fp32 master weights"),
                 ("optimizer_state", "optimizer state (moments)"),
                 ("comm_buffers", "communication buffers"), ("padding", "shard padding"))


def _memory_html(run: RunData) -> str:
    mem = (run.summary or {}).get("memory")
    if not isinstance(mem, dict):
        return ""
    stage = {0: "data parallel", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}.get(mem.get("stage"), "?")
    rows = [(label, f"{mem.get(key, 0) / 2**20:,.2f} MiB") for key, label in MEMORY_LABELS]
    total = sum(mem.get(k, 0) for k in ("params", "grads", "master_params", "optimizer_state"))
    rows.insert(4, ("model state (the four above)", f"{total / 2**20:,.2f} MiB"))
    return (f"<h2>Memory per rank</h2><p class='note'>What one rank of {_e(mem.get('world'))} "
            f"held at the last step's fullest ({_e(stage)}; "
            f"{_e(format(mem.get('num_params', 0), ','))} parameters), counted from the tensors "
            "themselves.</p>" + _table(rows))


def _drift_html(run: RunData) -> str:
    items = sorted({m.get("items") for m in run.metrics if m.get("items") is not None})
    exact = ("<p>Gradients: each step's gradient is the exact mean over every item of the "
             "global batch (<code>backward(loss, num_items=n)</code>, summed then divided by "
             f"the global count); items per step: {_e(', '.join(map(str, items)) or '-')}.</p>")
    d, c = run.drift, run.config
    if d is None and (c.get("strategy") == "zero3" or not c.get("drift_every", 1)):
        return exact + ("<p class='note'>Drift check: off (--drift-every 0).</p>"
                        if c.get("strategy") != "zero3" else
                        "<p class='note'>Drift check: not applicable (ZeRO-3: every rank holds "
                        "a different shard of the parameters).</p>")
    if d is None:
        return exact + "<p class='note'>Drift check: not run (--drift-every 0, or the run " \
                       "stopped before the first check).</p>"
    if not d.get("ok", True):
        return exact + (f"<p class='bad'>Drift check FAILED at step {_e(d.get('last_step'))}: "
                        f"{_e(d.get('error', 'replicas differ'))}</p>")
    return exact + (f"<p class='ok'>Drift check: replicas identical in all {_e(d.get('checks'))} "
                    f"check(s) (every {_e(d.get('every'))} steps and at the end; last at step "
                    f"{_e(d.get('last_step'))}; {_e(d.get('params', '?'))} parameters, bit-exact "
                    "checksums).</p>")


def _steps_table(run: RunData) -> str:
    cols = [("step", "d"), ("loss", ".4f"), ("eval_loss", ".4f"), ("lr", ".3g"),
            ("grad_norm", ".3g"), ("step_time_s", ".4f"), ("compute_s", ".4f"),
            ("exposed_comm_s", ".4f"), ("comm_bytes", ",d"), ("samples_per_s", ",.1f")]
    head = "".join(f"<th>{_e(c)}</th>" for c, _ in cols)
    body = "".join("<tr>" + "".join(f"<td>{_e(_fmt(m.get(c), f))}</td>" for c, f in cols)
                   + "</tr>" for m in run.metrics)
    return (f"<button id='toggle-steps' type='button'>Show per-step table</button>"
            f"<table id='steps' style='display:none'><tr>{head}</tr>{body}</table>")


def render_page(run: RunData, figures: dict[str, bytes], timelines: list[StepTimeline],
                missing: list[str]) -> str:
    parts = [f"<h1>gradsync run report</h1><p class='note'>{_e(os.path.abspath(run.path))} "
             f"&middot; generated {_e(time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))}</p>"]
    if missing:
        parts.append("<div class='missing'><b>Missing from this run:</b><ul>" + "".join(
            f"<li>{_e(x)}</li>" for x in missing) + "</ul></div>")
    parts.append("<h2>Summary</h2>" + _table(_key_numbers(run)))
    for name, png in figures.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<figure><img alt='{_e(name)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption>{_e(CAPTIONS.get(name, name))} ({_e(name)})</figcaption>"
                     "</figure>")
        if name == "timeline.png":
            notes = [n for t in timelines for n in t.notes]
            parts += [f"<p class='note'>{_e(n)}</p>" for n in notes]
    parts.append(_memory_html(run))
    parts.append("<h2>Exactness and replica drift</h2>" + _drift_html(run))
    if run.metrics:
        parts.append("<h2>Per-step metrics</h2>" + _steps_table(run))
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            "<title>gradsync report</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}"
            f"<script>{SCRIPT}</script></body></html>")


def write_report(run_dir: str) -> ReportResult:
    """Write report.html and the PNGs into ``run_dir``; UsageError if it is not a run."""
    run = load_run(run_dir)
    missing = list(run.missing)
    measured = predicted = None
    if run.trace is not None:
        measured = measured_step(run.trace)
        if measured is None:
            missing.append("trace.json holds no complete step")
        elif run.plan is not None:
            predicted = predicted_step(run.trace, run.plan,
                                       int(run.config.get("accumulation", 1)), measured.step)
            if predicted is None:
                missing.append("planner (gradsync.plan.simulate) not installed: "
                               "no predicted timeline")
    figures = make_figures(run, measured, predicted)
    pngs = []
    for name, png in figures.items():  # each atomic: a full disk leaves the old figure
        path = os.path.join(run_dir, name)
        write_bytes(path, png, "a figure of the report")
        pngs.append(path)
    page = render_page(run, figures, [t for t in (measured, predicted) if t], missing)
    out = os.path.join(run_dir, REPORT)
    write_text(out, page, "the report")
    return ReportResult(out, pngs, missing)
