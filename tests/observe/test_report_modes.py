"""An honest report per sync mode (issue 22, point 1), read in a real headless browser.

One module fixture trains three tiny runs (tiny64, float64, 2 gloo workers, 6
steps) and writes their reports:

* ``exact``: ``--sync exact``, stopped after step 3 and continued on 3 workers
  (resume markers and the worker count of each stretch);
* ``int8``: ``--compress int8 --probe-every 2``;
* ``diloco``: ``--sync diloco --sync-every 2``, 8 steps, the held-out loss every 3
  steps (step 3 between syncs, 6 right after one, 8 at the end) and the drift check
  at most every 4 steps (after 3 of the 4 syncs).

Every page is loaded in chromium and its text read back by section: what the
exactness section promises, the bytes sent and the ratio to exact as numbers
(checked against sums taken here from metrics.jsonl and the model's size:
155 float64 parameters, 1240 bytes of gradient), the drift line, the timeline
section, and captions that describe only what is drawn. Each claim the page makes is
compared with the run's files (issue 37): the evaluated steps between syncs against
metrics.jsonl's ``one_model``, the checks against drift.json's steps, the residual's
bytes against summary.json's memory, the strategy's and the precision's names against
config.json.
"""

import json

import pytest

import gradsync as gs
from gradsync.observe.exactness import drift_text
from gradsync.observe.report import write_report
from gradsync.rundir import CONFIG, DRIFT, METRICS, REPORT, SUMMARY, Summary, read_metrics
from gradsync.train.records.summary import _traffic_line
from tests.browser import needs_chromium, run_page

GRAD = 155 * 8  # tiny64's gradient in bytes
STEP_FIGURES = ["loss.png", "throughput.png", "step_breakdown.png", "communication.png"]


def ring(nbytes, world):
    return 2 * (world - 1) * nbytes // world


def _cfg(out, **kw):
    base = dict(workers=2, steps=6, global_batch=12, micro_batch=2, lr=0.05, warmup=2,
                optimizer="sgd", out=str(out), clip=0.0, checkpoint_every=0, eval_every=0,
                drift_every=2, no_report=True, seed=0, timeout=60,
                model="tests.train.factories:tiny64", data="tests.train.factories:regression64")
    return gs.TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    gs.train(_cfg(root / "exact"), faults=gs.FaultInjector().fail_at(None, 3, "stop"))
    gs.train(_cfg(root / "exact", workers=3))
    gs.train(_cfg(root / "int8", compress="int8", probe_every=2))
    gs.train(_cfg(root / "diloco", sync="diloco", sync_every=2, steps=8, eval_every=3,
                  drift_every=4))
    for name in ("exact", "int8", "diloco"):
        write_report(str(root / name))
    return root


def _metrics(run):
    return read_metrics(str(run / METRICS))[0]


def _json(run, name):
    return json.loads((run / name).read_text())


TAIL = """<script>(function(){
 var out={errors:window.__gsErrors, rows:{}, captions:{}, sections:{}, missing:[], images:[]};
 try{
  var rows=document.querySelector('table').rows;
  for(var i=0;i<rows.length;i++){out.rows[rows[i].cells[0].innerText]=rows[i].cells[1].innerText;}
  var figs=document.getElementsByTagName('figure');
  for(var i=0;i<figs.length;i++){var img=figs[i].querySelector('img');
   out.images.push(img.complete && img.naturalWidth>0);
   out.captions[img.alt]=figs[i].querySelector('figcaption').innerText;}
  var hs=document.getElementsByTagName('h2');
  for(var i=0;i<hs.length;i++){var t=[], n=hs[i].nextElementSibling;
   while(n && n.tagName!=='H2'){t.push(n.innerText); n=n.nextElementSibling;}
   out.sections[hs[i].innerText]=t.join('\\n');}
  var li=document.querySelectorAll('.missing li');
  for(var i=0;i<li.length;i++){out.missing.push(li[i].innerText);}
 }catch(e){out.errors.push('harness: '+e);}
 var pre=document.createElement('pre');pre.id='gs-test-result';
 pre.textContent=JSON.stringify(out);document.body.appendChild(pre);})();</script>"""


def _page(run, tmp_path):
    out = run_page((run / REPORT).read_text(), TAIL, tmp_path)
    assert out["images"] and all(out["images"])
    return out


def _common(page, held_out=False):
    exactness = page["sections"]["Exactness and replica drift"]
    timeline = page["sections"]["Timeline of one step"]
    assert "this run was not traced" in timeline and "gradsync train --trace" in timeline
    caps = page["captions"]
    assert "Middle: the gradient norm each step" in caps["loss.png"]
    # no caption for a line that is not drawn: no baseline here, a held-out loss where asked
    assert ("held-out" in caps["loss.png"]) == held_out and "Dashed" not in caps["throughput.png"]
    return exactness, caps


@needs_chromium
def test_exact_run_says_exact_and_marks_where_it_resumed_on_three_workers(runs, tmp_path):
    run = runs / "exact"
    m = _metrics(run)
    assert [(r["step"], r["world_size"]) for r in m] == [(s, 2 if s <= 3 else 3)
                                                         for s in range(1, 7)]
    sent = sum(r["sent_bytes"] for r in m)
    assert sent == 3 * ring(GRAD, 2) + 3 * ring(GRAD, 3) == 8679
    page = _page(run, tmp_path)
    exactness, caps = _common(page)
    assert "Gradients: exact. Each step's gradient is the exact mean over every item" \
        in exactness
    assert "not exact" not in exactness
    line = "8.48 KiB (8,679 B) over 6 steps; ratio to exact 1 (this is the exact all-reduce's"
    assert page["rows"]["bytes sent (rank 0)"].startswith(line)
    checked = _json(run, DRIFT)["steps"]  # the run's checks, before and after the resume
    assert checked == [2, 4, 6]
    assert ("Drift check: replicas identical in all 3 checks at steps 2, 4, 6 (every 2 steps"
            in exactness)
    assert page["rows"]["strategy / precision / optimizer"] == "ddp / fp64 / sgd"  # float64
    stretches = "steps 1-3: 2 workers; resumed from step 3: steps 4-6: 3 workers"
    assert page["rows"]["workers per stretch"] == stretches
    assert page["rows"]["workers"] == "3 (over the run: 2 -> 3)"
    for name in STEP_FIGURES:  # every curve over steps carries the marks, and says so
        assert f"Dotted lines: the run resumed after step 3; the label at the top of each " \
               f"stretch is its worker count ({stretches})." in caps[name], name
    assert "Dotted" not in caps["memory.png"]
    assert "cosine" not in caps["communication.png"]  # nothing probed: no such line
    assert page["missing"] == []


@needs_chromium
def test_int8_run_states_compressor_ratio_and_probed_distance(runs, tmp_path):
    run = runs / "int8"
    m = _metrics(run)
    sent, exact = sum(r["sent_bytes"] for r in m), 6 * ring(GRAD, 2)
    assert m[0]["sent_bytes"] == ring(GRAD, 2) and sent < exact / 3  # step 1 exact, then int8
    probed = [r for r in m if "grad_cosine" in r]
    assert [r["step"] for r in probed] == [2, 4, 6]
    page = _page(run, tmp_path)
    exactness, caps = _common(page)
    assert "Gradients: not exact, by design (--compress int8)" in exactness
    assert "int8: blockwise 8-bit quantisation, one scale per block of 256" in exactness
    assert "Each step's gradient is the exact mean" not in exactness
    ratio = f"ratio to exact {sent / exact:.3g} (exact all-reduce: 7.27 KiB (7,440 B); " \
            f"{exact / sent:.3g}x less)"
    assert page["rows"]["bytes sent (rank 0)"] == f"{size(sent)} over 6 steps; {ratio}"
    assert ratio in exactness
    cos = [r["grad_cosine"] for r in probed]
    err = [r["grad_rel_error"] for r in probed]
    assert 0.99 < min(cos) and 0 < max(err) < 0.1
    assert (f"probed on steps 2, 4, 6 (--probe-every 2): cosine with the exact gradient "
            f"{cos[-1]:.6f} at the last probe, lowest {min(cos):.6f}; relative error "
            f"|compressed - exact| / |exact| {err[-1]:.3g} at the last probe, highest "
            f"{max(err):.3g}.") in exactness
    assert "Drift check: replicas identical in all 3 checks at steps 2, 4, 6" in exactness
    assert "cosine between the compressed and the exact gradient" in caps["communication.png"]
    assert "Red line: what the exact all-reduce" in caps["communication.png"]
    assert "ticks" not in caps["communication.png"]  # a line, said as one
    # every rank holds the compressor's gradient-sized residual: counted, by name
    held = _json(run, SUMMARY)["memory"]["residuals"]
    assert held >= GRAD
    memory = page["sections"]["Memory per rank"]
    assert f"error-feedback residual (the compressor's)\t{size(held)}" in memory
    assert "Dotted" not in caps["loss.png"]  # never resumed: no marks, no such sentence


@needs_chromium
def test_diloco_run_states_replicas_differ_between_syncs_and_checks_after_them(runs,
                                                                                tmp_path):
    run = runs / "diloco"
    m = _metrics(run)
    sent = [r["sent_bytes"] for r in m]
    assert [s > 0 for s in sent] == [False, True] * 4  # a sync every 2 steps
    page = _page(run, tmp_path)
    exactness, caps = _common(page, held_out=True)
    assert "Gradients: local updates, not exact by design (DiLoCo, H=2" in exactness
    assert "between syncs the replicas differ by design" in exactness
    assert "makes the replicas identical again" in exactness
    assert "exact mean over every item of the global batch" not in exactness
    # the checks drift.json holds, after 3 of the syncs metrics.jsonl records
    syncs = [r["step"] for r in m if r.get("one_model")]
    checked = _json(run, DRIFT)["steps"]
    assert syncs == [2, 4, 6, 8] and checked == [2, 6, 8]
    assert ("Drift check: replicas identical in all 3 checks at steps 2, 6, 8, each right "
            "after a sync (syncs every 2 steps; the run synced 4 times, at steps 2, 4, 6, 8; "
            "checked at the first, then at the first at least 4 steps after the last check, "
            "and at the end); last at step 8") in exactness
    # the held-out loss: one model's after a sync, the replicas' mean between syncs
    evals = [(r["step"], r["one_model"]) for r in m if "eval_loss" in r]
    assert evals == [(3, False), (6, True), (8, True)]
    assert ("Red dots: the held-out loss, exact over the whole held-out set (the one model "
            "every worker holds after a sync: steps 6, 8).") in caps["loss.png"]
    assert ("Hollow red circles (step 3, between syncs): each worker scores its own replica "
            "on its share of the held-out set") in caps["loss.png"]
    total, exact = sum(sent), 8 * ring(GRAD, 2)
    assert page["rows"]["bytes sent (rank 0)"] == (
        f"{size(total)} over 8 steps; ratio to exact {total / exact:.3g} (exact all-reduce: "
        f"9.69 KiB (9,920 B); {exact / total:.3g}x less)")
    assert 0.45 < total / exact < 0.55  # one sync per two steps, plus item counts
    assert page["missing"] == []  # no drift.json or plan.json "missing": neither is due
    assert "rank 0's local gradient" in caps["loss.png"]
    assert page["rows"]["gradient buckets"].startswith("none: local updates")
    # the method by its name, the model's own dtype by its; DiLoCo's outer copy by its name
    assert _json(run, CONFIG)["param_dtype"] == "float64"
    assert page["rows"]["strategy / precision / optimizer"] == "diloco / fp64 / sgd"
    memory = page["sections"]["Memory per rank"]
    assert "(DiLoCo; 155 parameters)" in memory and "master weights" not in memory
    assert "outer copy (the global model DiLoCo keeps between syncs)\t1.21 KiB (1,240 B)" \
        in memory


def size(n):
    return f"{n / 1024:.3g} KiB ({n:,} B)" if n >= 1024 else f"{n:,} B"


def test_terminal_bytes_line_and_summary_totals(runs):
    """The closing table's "bytes sent (rank 0)" row is built by summary._traffic_line from
    summary.json's gradient sizes and every attempt's metrics (the workers print it from
    their own processes, so it is read here from the function that builds it)."""
    for name in ("exact", "int8", "diloco"):
        run = runs / name
        s = json.loads((run / SUMMARY).read_text())
        sent = sum(r["sent_bytes"] for r in _metrics(run))
        steps = 8 if name == "diloco" else 6
        exact = 8679 if name == "exact" else steps * ring(GRAD, 2)
        assert s["gradient_bytes"] == [GRAD] and (s["sent_bytes"], s["exact_bytes"]) == (
            sent, exact), name
        line = _traffic_line(_cfg(run).resolved(), Summary.from_json(s))
        assert line.startswith(f"{size(sent)} over {steps} steps; ratio to exact "), line
        if name != "exact":
            assert f"{sent / exact:.3g} (exact all-reduce: {size(exact)}" in line


def test_closing_table_counts_checks_and_syncs_in_words(runs):
    """The closing table's drift line (the workers print it; built by observe's drift_text
    from drift.json and metrics.jsonl): a count in the singular, the syncs checked."""
    diloco = runs / "diloco"
    cfg = _json(diloco, CONFIG)
    assert drift_text(_json(diloco, DRIFT), cfg, _metrics(diloco), short=True) == \
        "replicas identical in 3 checks, after 3 of the run's 4 syncs"
    one = {"checks": 1, "ok": True, "every": 50, "at": "steps", "steps": [6]}
    assert drift_text(one, {}, [], short=True) == "replicas identical (1 check)"
    assert "in 1 check at step 6 (every 50 steps" in drift_text(one, {}, [])
    every = {**_json(diloco, DRIFT), "checks": 4, "steps": [2, 4, 6, 8]}
    assert drift_text(every, cfg, _metrics(diloco), short=True) == \
        "replicas identical after every sync (4 checks)"
