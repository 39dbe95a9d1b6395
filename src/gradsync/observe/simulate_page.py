"""One self-contained HTML page with live sliders over the step simulator.

Why JavaScript at all: sliders must answer instantly without a server. Why the
page still carries the Python result: the JS is a second implementation, so the
page embeds Python's answer for the initial settings and shows whether the JS
reproduces it (the browser test checks this too) -- one source of truth, checked.

No network: the JS and CSS are inlined, pictures are inline SVG, no CDN.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from importlib import resources

from ..errors import UsageError
from ..plan.profile import PROFILE_VERSION, StepProfile
from ..plan.simulate import StepResult, Sweep

CSS = """
body{font:14px system-ui,sans-serif;margin:20px;color:#222;max-width:960px}
h1{font-size:20px} .kpis{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}
.kpi{border:1px solid #ddd;border-radius:6px;padding:6px 10px;min-width:120px}
.kpi b{display:block;font-size:18px} .kpi span{color:#666;font-size:12px}
.ctl{display:grid;grid-template-columns:180px 380px 140px;gap:6px;align-items:center}
svg{border:1px solid #eee;background:#fff;width:100%;height:auto}
.fwd{fill:#9ecae1}.bwd{fill:#3182bd}.bwd2{fill:#6baed6}.opt{fill:#31a354}
.ar{fill:#e6550d}.ar2{fill:#fd8d3c}.exposed{fill:red;opacity:.15}
.curve{fill:none;stroke:#3182bd;stroke-width:2}.default{stroke:#888;stroke-dasharray:4 3}
.current{stroke:#e6550d}.best{fill:red}.lane,.axis{font-size:11px;fill:#444}
#agree{margin:8px 0;color:#555}
"""

BODY = """
<h1>gradsync simulate: backward / all-reduce overlap</h1>
<p>{desc}</p>
<div class="ctl">
 <label for="s-bucket">bucket cap (MB = MiB)</label>
 <input id="s-bucket" type="range" min="0" max="11" step="0.01"><span id="v-bucket"></span>
 <label for="s-bw">bandwidth (GB/s, 1e9)</label>
 <input id="s-bw" type="range" min="-2" max="3" step="0.01"><span id="v-bw"></span>
 <label for="s-alpha">latency per all-reduce</label>
 <input id="s-alpha" type="range" min="0" max="5" step="0.01"><span id="v-alpha"></span>
 <label for="s-layers">layers <small id="layers-note"></small></label>
 <input id="s-layers" type="range" min="1" max="{max_layers}" step="1"><span id="v-layers"></span>
</div>
<div class="kpis">
 <div class="kpi"><span>step time</span><b id="kpi-step"></b></div>
 <div class="kpi"><span>backward</span><b id="kpi-bwd"></b></div>
 <div class="kpi"><span>communication</span><b id="kpi-comm"></b></div>
 <div class="kpi"><span>exposed comm</span><b id="kpi-exposed"></b></div>
 <div class="kpi"><span>scaling efficiency</span><b id="kpi-eff"></b></div>
 <div class="kpi"><span>buckets</span><b id="kpi-buckets"></b></div>
</div>
<div id="agree"></div>
<h2>Timeline (compute lane, communication lane, exposed communication shaded)</h2>
<svg id="timeline" viewBox="0 0 900 120"></svg>
<h2>Bucket-size sweep, 1 MB .. 2 GB: the valley</h2>
<div class="kpis">
 <div class="kpi"><span>optimal bucket</span><b id="kpi-opt"></b></div>
 <div class="kpi"><span>optimal step</span><b id="kpi-opt-step"></b></div>
 <div class="kpi"><span>25 MB default step</span><b id="kpi-def-step"></b></div>
 <div class="kpi"><span>default vs optimal</span><b id="kpi-gap"></b></div>
</div>
<svg id="sweep" viewBox="0 0 900 240"></svg>
<p><small>Model: buckets from gradsync's own plan_buckets (reverse registration order,
first bucket {first:g} MB); bucket k starts when its last gradient is ready and bucket k-1
is done; cost alpha + 2(N-1)/N x bytes / bandwidth (ring all-reduce), N = {world}.
{accum} micro-step(s), communication on the last.</small></p>
"""


def _json_for_script(obj) -> str:
    return json.dumps(obj).replace("</", "<\\/")


def render_simulate_page(
    profile: StepProfile,
    result: StepResult,
    sweep: Sweep,
    synthetic: dict | None = None,
) -> str:
    """The page for ``result`` (simulated from ``profile``); ``synthetic`` holds the
    ``synthetic_profile`` arguments when the profile came from it (enables the layer slider)."""
    if profile.beta_s_per_byte <= 0:
        raise UsageError("the interactive page needs a finite bandwidth (beta > 0)")
    layers = synthetic["layers"] if synthetic else len(profile.params)
    data = {
        "version": PROFILE_VERSION,
        "synthetic": (
            {k: synthetic[k] for k in ("params_per_layer", "backward_s_per_layer",
                                       "tensors_per_layer", "itemsize", "forward_s",
                                       "optimizer_s", "world_size")}
            if synthetic else None
        ),
        "profile": None if synthetic else {
            **{k: v for k, v in asdict(profile).items() if k != "params"},
            "params": [asdict(p) for p in profile.params],
        },
        "initial": {
            "bucket_mb": result.bucket_cap_mb,
            "first_bucket_mb": result.first_bucket_mb,
            "accum_steps": result.accum_steps,
            "bandwidth": 1.0 / profile.beta_s_per_byte,
            "alpha_s": profile.alpha_s,
            "layers": layers,
        },
        "python": {"step_s": result.step_s, "comm_s": result.comm_s,
                   "exposed_s": result.exposed_s, "efficiency": result.efficiency,
                   "n_buckets": len(result.buckets),
                   "sweep_optimum_mb": sweep.optimum_mb, "sweep_optimum_s": sweep.optimum_s},
        "sweep_sizes_mb": list(sweep.sizes_mb),
    }
    js = resources.files(__package__).joinpath("simulate_page.js").read_text(encoding="utf-8")
    desc = (f"{len(profile.params)} parameters, {sum(p.numel for p in profile.params):,} "
            f"elements; initial settings simulated by Python: step {result.step_s * 1e3:.3f} ms.")
    body = BODY.format(desc=html.escape(desc), max_layers=max(200, layers),
                       first=result.first_bucket_mb, world=profile.world_size,
                       accum=result.accum_steps)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>gradsync simulate</title>"
        f"<style>{CSS}</style></head><body>{body}"
        f"<script id=\"gs-data\" type=\"application/json\">{_json_for_script(data)}</script>"
        f"<script>\n{js}\n</script></body></html>\n"
    )
