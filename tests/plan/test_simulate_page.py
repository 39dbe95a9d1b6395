"""The interactive page: self-contained, and its JavaScript agrees with Python.

The browser part drives Debian's chromium headless with ``--dump-dom``: a small
harness script is appended to the generated page; it records uncaught errors and
console.error calls, reads the step time the page shows, moves the sliders by
setting their value and dispatching the same ``input`` event a drag fires, and
writes what it saw into the DOM, which chromium dumps after the page has run.
Chromium's own console log (--enable-logging=stderr) must show no console message.
"""

import json
import re

import pytest

from gradsync.observe.simulate_page import render_simulate_page
from gradsync.plan.profile import ParamProfile, synthetic_profile
from gradsync.plan.simulate import simulate_step, sweep_bucket_sizes
from tests.browser import needs_chromium, run_page

KW = dict(layers=24, params_per_layer=1_000_000, backward_s_per_layer=2e-3, tensors_per_layer=4,
          itemsize=4, forward_s=None, optimizer_s=1e-3, alpha_s=1e-3, bandwidth=1e9, world_size=2)


def make_page(**over):
    kw = KW | over
    prof = synthetic_profile(**kw)
    res = simulate_step(prof, 25.0)
    return prof, res, render_simulate_page(prof, res, sweep_bucket_sizes(prof), kw)


def test_page_is_self_contained():
    _, res, page = make_page()
    assert "<link" not in page and " src=" not in page and " href=" not in page
    urls = set(re.findall(r"https?://[^\s\"')]+", page))
    assert urls <= {"http://www.w3.org/2000/svg"}
    data = json.loads(re.search(r'id="gs-data"[^>]*>(.*?)</script>', page, re.S).group(1))
    assert data["python"]["step_s"] == res.step_s
    assert data["initial"]["bucket_mb"] == 25.0


TAIL = """<script>(function(){
 var out={errors:window.__gsErrors, runs:[]};
 function read(){var k=document.getElementById('kpi-step');
   return {step:parseFloat(k.dataset.value), text:k.textContent,
           agree:document.getElementById('agree').dataset.agree};}
 function move(id,v){var s=document.getElementById(id);s.value=String(v);
   s.dispatchEvent(new Event('input',{bubbles:true}));}
 try{
  out.initial=read();
  var moves=%s;
  for(var i=0;i<moves.length;i++){move(moves[i][0],moves[i][1]);out.runs.push(read());}
 }catch(e){out.errors.push('harness: '+e);}
 var pre=document.createElement('pre');pre.id='gs-test-result';
 pre.textContent=JSON.stringify(out);document.body.appendChild(pre);})();</script>"""


def run_in_chromium(page, moves, tmp_path):
    """Load the page with the harness; returns what the harness saw."""
    return run_page(page, TAIL % json.dumps(moves), tmp_path)


@needs_chromium
def test_page_in_headless_chromium(tmp_path):
    prof, res, page = make_page()
    moves = [["s-bucket", 0], ["s-bucket", 3.5], ["s-layers", 7], ["s-bw", 0.5], ["s-alpha", 2]]
    out = run_in_chromium(page, moves, tmp_path)

    # at the initial settings the JavaScript reproduces Python's step time
    assert out["initial"]["agree"] == "true"
    assert out["initial"]["step"] == pytest.approx(res.step_s, rel=1e-12)
    assert out["initial"]["text"] == f"{res.step_s * 1e3:.2f} ms"

    # moving the bucket slider changes the shown step time ...
    assert out["runs"][0]["step"] != out["initial"]["step"]
    assert out["runs"][0]["text"] != out["initial"]["text"]
    # ... and every moved state still matches a Python simulation of the same settings
    kw, bucket = dict(KW), 25.0
    for (slider, v), seen in zip(moves, out["runs"]):
        if slider == "s-bucket":
            bucket = 2.0 ** v
        elif slider == "s-layers":
            kw["layers"] = v
        elif slider == "s-bw":
            kw["bandwidth"] = 10.0 ** v * 1e9
        else:
            kw["alpha_s"] = 10.0 ** v * 1e-6
        expect = simulate_step(synthetic_profile(**kw), bucket).step_s
        assert seen["step"] == pytest.approx(expect, rel=1e-9), (slider, v)
        assert seen["agree"] == "n/a"


@needs_chromium
@pytest.mark.parametrize("penalties", [(0.0, 0.0), (0.4, 0.5)])
def test_profile_page_non_uniform_in_chromium(tmp_path, penalties):
    """A measured (non-uniform, mixed-dtype) profile: no layer slider, same agreement.

    With overlap penalties (gradsync calibrate's default) the JavaScript runs the
    contended schedule of plan/contention.py and must still agree with Python.
    """
    base = synthetic_profile(layers=6, params_per_layer=300_000, tensors_per_layer=3)
    params = tuple(
        ParamProfile(p.name, p.numel * (1 + k % 4), 2 if k % 5 == 0 else 4,
                     p.backward_s * (0.5 + k % 3), "bfloat16" if k % 5 == 0 else "float32")
        for k, p in enumerate(base.params)
    )
    prof = base.with_(params=params, optimizer_s=3e-3, overlap_compute_penalty=penalties[0],
                      overlap_comm_penalty=penalties[1])
    res = simulate_step(prof, 2.0, 0.5)
    page = render_simulate_page(prof, res, sweep_bucket_sizes(prof, first_bucket_mb=0.5))
    out = run_in_chromium(page, [["s-bucket", 5]], tmp_path)
    assert out["initial"]["agree"] == "true"
    assert out["initial"]["step"] == pytest.approx(res.step_s, rel=1e-12)
    expect = simulate_step(prof, 32.0, 0.5).step_s
    assert out["runs"][0]["step"] == pytest.approx(expect, rel=1e-9)
    assert out["runs"][0]["step"] != out["initial"]["step"]
