"""`gradsync train --trace --baseline` end to end, and the report it writes at the end.

One short real run (2 gloo workers, 4 steps, seq-len 32) feeds every test here:
the run directory holds the metrics, the merged trace, the drift result and
report.html with its PNGs. The page is loaded in Debian's headless chromium with
the planner's harness (tests/plan/test_simulate_page.py): no uncaught error, no
console message, every inline image decoded, the script's button works.
"""

import contextlib
import io
import json
import re

import matplotlib.image
import pytest

from gradsync.cli import main as cli_main
from gradsync.observe.report import REPORT
from tests.browser import needs_chromium, run_page

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FIGURES = ["loss.png", "throughput.png", "step_breakdown.png", "communication.png", "timeline.png",
           "memory.png"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("observe") / "run"
    # in this process (workers fork from its forkserver), not a new interpreter: the run's
    # files are the same; rank 0's own lines ("report: PATH") go to the forkserver's stdout
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        code = cli_main(["train", "--steps", "4", "--seq-len", "32", "--global-batch", "8",
                         "--micro-batch", "2", "--trace-steps", "2:3", "--drift-every", "2",
                         "--baseline", "--baseline-steps", "2", "--out", str(out)])
    assert code == 0, said.getvalue()[-3000:]
    assert (out / REPORT).is_file()
    return out


def test_run_records_step_metrics_trace_drift_and_efficiency(run_dir):
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:
        assert m["step_time_s"] > 0 and m["exposed_comm_s"] >= 0
        assert m["compute_s"] == pytest.approx(m["step_time_s"] - m["exposed_comm_s"])
        assert m["comm_bytes"] > 0 and m["collectives"] >= 3  # header, buckets, stats
        assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 32)
        assert len(m["peak_mem_mb_by_rank"]) == 2 and min(m["peak_mem_mb_by_rank"]) > 10
        assert 0 < m["scaling_efficiency"] < 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["drift"]["ok"] and summary["drift"]["checks"] == 2  # steps 2 and 4
    assert summary["traced_steps"] == [2, 3] and summary["scaling_efficiency"] > 0
    trace = json.loads((run_dir / "trace.json").read_text())
    steps = {(e["pid"], e["args"]["step"]) for e in trace["traceEvents"] if e.get("cat") == "step"}
    assert steps == {(0, 2), (0, 3), (1, 2), (1, 3)}
    assert (run_dir / "baseline" / "summary.json").exists()


def test_pngs_open(run_dir):
    for name in FIGURES:
        data = (run_dir / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE), name
        img = matplotlib.image.imread(run_dir / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, name


def test_report_is_self_contained(run_dir):
    page = (run_dir / REPORT).read_text()
    assert "<link" not in page and "@import" not in page
    assert re.findall(r"https?://", page) == []
    srcs = re.findall(r"src='([^']*)'", page)
    assert len(srcs) == len(FIGURES) and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "profile from the traced step" in page  # the simulator's prediction is shown
    assert "replicas identical in all 2 checks at steps " in page


TAIL = """<script>(function(){
 var out={errors:window.__gsErrors, images:[], toggled:null};
 try{
  var imgs=document.getElementsByTagName('img');
  for(var i=0;i<imgs.length;i++){out.images.push(imgs[i].complete && imgs[i].naturalWidth>0);}
  document.getElementById('toggle-steps').click();
  out.toggled=document.getElementById('steps').style.display;
 }catch(e){out.errors.push('harness: '+e);}
 var pre=document.createElement('pre');pre.id='gs-test-result';
 pre.textContent=JSON.stringify(out);document.body.appendChild(pre);})();</script>"""


@needs_chromium
def test_report_renders_in_headless_chromium(run_dir, tmp_path):
    out = run_page((run_dir / REPORT).read_text(), TAIL, tmp_path)
    assert out["images"] == [True] * len(FIGURES)
    assert out["toggled"] == ""  # the inline script ran: the hidden table is shown
