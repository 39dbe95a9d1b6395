"""The report's "Fault tolerance" section, from a replica group's run directory written here.

No training: config.json, metrics.jsonl and summary.json are written by hand in the
shapes ``gradsync train --ft-group`` writes them (docs/fault_tolerance.md), for
group 1 of 3 with one worker. Group 2 dies during step 3, which this group redoes
twice before it commits with groups 0 and 1; this group is then killed after step 4
(checkpointed), its launcher restarts it, and it heals from group 0 at step 6; group
2 is back from step 7. The page is read in headless chromium: the section's table
by row name, the summary table's fault-tolerance row, the caption, the figure. A run
without ``quorum`` in its metrics (the same run, not fault-tolerant) has no section
(read from the page's text, so that check runs without chromium too).
"""

import json

import matplotlib.image
import pytest

from gradsync.observe.ft_view import ft_figure
from gradsync.observe.report import write_report
from gradsync.observe.run_data import load_run
from gradsync.rundir import CONFIG, METRICS, REPORT, SUMMARY
from tests.browser import needs_chromium, run_page

FIGURE = "fault_tolerance.png"
CONFIG_FIELDS = dict(steps=8, global_batch=10, micro_batch=2, accumulation=3, world_size=1,
                     world_sizes=[1], seed=0, model="tests.train.factories:tiny64",
                     data="tests.train.factories:regression64", strategy="ddp",
                     precision="fp32", optimizer="sgd", sync="exact", compress="none",
                     balance="off", trace=False, drift_every=0, eval=False)
# step: (quorum, attempts, lost_s, quorum_s, healed, time_s, unix_time)
STEPS = {1: ([0, 1, 2], 1, 0.0, 0.05, False, 0.2, 1000.2),
         2: ([0, 1, 2], 1, 0.0, 0.04, False, 0.3, 1000.3),
         3: ([0, 1], 3, 2.5, 1.25, False, 4.1, 1004.1),  # group 2 died: redone twice
         4: ([0, 1], 1, 0.0, 0.03, False, 4.2, 1004.2),
         6: ([0, 1], 1, 0.0, 1.75, True, 0.4, 1009.4),  # restarted, healed from group 0
         7: ([0, 1, 2], 1, 0.0, 0.5, False, 0.5, 1009.9),  # group 2 back
         8: ([0, 1, 2], 1, 0.0, 0.02, False, 0.6, 1010.0)}
RESTART = {"event": "restart", "step": 4, "attempt": 1, "max_restarts": 2, "reached_step": 4,
           "failed": [{"rank": 0, "how": "was killed by signal SIGKILL", "exitcode": -9}],
           "world_size": 1, "unix_time": 1006.0}
FT = {"group": 1, "groups": 3, "redone_steps": 1, "failed_attempts": 2, "heals": 1,
      "lost_s": 2.5, "quorum_s": 3.64, "steps_by_quorum_size": {"3": 4, "2": 3}}


def _record(step, ft):
    quorum, attempts, lost, wait, healed, t, unix = STEPS[step]
    rec = {"step": step, "loss": 1.0 / step, "lr": 0.01, "items": 10, "grad_norm": 0.5,
           "skipped": False, "time_s": t, "unix_time": unix, "step_time_s": 0.1,
           "compute_s": 0.08, "exposed_comm_s": 0.02, "samples_per_s": 100.0,
           "world_size": len(quorum) if ft else 1}
    if ft:
        rec.update(quorum=quorum, attempts=attempts, lost_s=lost, quorum_s=wait)
        if healed:
            rec["healed"] = True
    return rec


def make_run(path, ft=True):
    """A group's run directory as train writes it; ``ft=False``: the same run without quorums."""
    path.mkdir()
    cfg = dict(CONFIG_FIELDS, **({"ft_groups": 3, "ft_group": 1} if ft else {}))
    (path / CONFIG).write_text(json.dumps(cfg))
    lines = [_record(s, ft) for s in STEPS if s <= 4] + [RESTART] + \
        [_record(s, ft) for s in STEPS if s > 4]
    (path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = {"steps": 8, "world_size": 1, "median_step_s": 0.1, "optimizer": "sgd"}
    if ft:
        summary["fault_tolerance"] = FT
    (path / SUMMARY).write_text(json.dumps(summary))
    write_report(str(path))
    return path


TAIL = """<script>(function(){
 var out={errors:window.__gsErrors, sections:{}, tables:{}, captions:{}, images:[]};
 try{
  var figs=document.getElementsByTagName('figure');
  for(var i=0;i<figs.length;i++){var img=figs[i].querySelector('img');
   out.images.push(img.complete && img.naturalWidth>0);
   out.captions[img.alt]=figs[i].querySelector('figcaption').innerText;}
  var hs=document.getElementsByTagName('h2');
  for(var i=0;i<hs.length;i++){var t=[], rows={}, n=hs[i].nextElementSibling;
   while(n && n.tagName!=='H2'){t.push(n.innerText);
    if(n.tagName==='TABLE'){for(var j=0;j<n.rows.length;j++){var c=n.rows[j].cells;
     if(c.length===2){rows[c[0].innerText]=c[1].innerText;}}}
    n=n.nextElementSibling;}
   out.sections[hs[i].innerText]=t.join('\\n'); out.tables[hs[i].innerText]=rows;}
 }catch(e){out.errors.push('harness: '+e);}
 var pre=document.createElement('pre');pre.id='gs-test-result';
 pre.textContent=JSON.stringify(out);document.body.appendChild(pre);})();</script>"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft_report")
    return make_run(root / "group-1"), make_run(root / "plain", ft=False)


@needs_chromium
def test_ft_section_counts_redone_steps_heals_restarts_and_waits(runs, tmp_path):
    run, _ = runs
    page = run_page((run / REPORT).read_text(), TAIL, tmp_path)
    assert page["images"] and all(page["images"])
    table = page["tables"]["Fault tolerance"]
    assert table == {
        "steps with 3 of 3 groups in the quorum": "4 (steps 1-2, 7-8)",
        "steps with 2 of 3 groups in the quorum": "3 (steps 3-4, 6)",
        "steps redone": "1 (step 3)",
        "failed attempts": "2",
        "heals": "1 (step 6)",
        "restarts": "1 (back at step 6)",
        "seconds lost in failed attempts": "2.50 s",
        "longest quorum wait": "1.75 s at step 6",
        "seconds waiting for quorums": "3.64 s over 7 steps",
    }
    summary = page["tables"]["Summary"]
    assert summary["fault tolerance"] == (
        "group 1 of 3; steps by quorum size: 4 steps on 3 groups, 3 steps on 2 groups; "
        "1 redone (2 failed attempts), 1 heal, 2.5 s lost, 3.6 s waiting for quorums")
    # a quorum that shrank is not a resume; the restart is (its clock starts again)
    assert summary["workers per stretch"] == \
        "steps 1-4: 1 worker; resumed from step 5: steps 6-8: 1 worker"
    caption = page["captions"][FIGURE]
    for drawn in ("Dashed: all 3 groups of the run.", "Red crosses: steps redone",
                  "Green triangles: steps at which this group received",
                  "Dash-dotted lines: this group's workers restarted",
                  "Bottom: the seconds each step's committing attempt waited for its quorum, "
                  "with the seconds spent in its failed attempts stacked on top in red.",
                  "Dotted lines: the run resumed after step 5"):
        assert drawn in caption, drawn
    assert FIGURE not in page["sections"]["Summary"]  # in its own section, not with the curves
    img = matplotlib.image.imread(run / FIGURE)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_caption_names_only_what_is_drawn(runs, tmp_path):
    """A group that never saw a failure: quorum bars and waits, no crosses, triangles or
    restart lines, and a caption that mentions none of them."""
    run = load_run(str(runs[0]))
    run.metrics = [dict(m, attempts=1, lost_s=0.0, healed=False) for m in run.metrics[:4]]
    run.events = []
    fig, caption = ft_figure(run)
    assert caption.startswith("Top, bars: how many replica groups' gradients each step")
    for absent in ("Red crosses", "Green triangles", "Dash-dotted", "red"):
        assert absent not in caption, absent
    assert "waited for its quorum." in caption


def test_run_without_quorums_has_no_ft_section(runs):
    """Read from the page's text: no chromium needed to see a section is absent."""
    _, plain = runs
    page = (plain / REPORT).read_text()
    assert "<h2>Summary</h2>" in page and "<h2>Exactness and replica drift</h2>" in page
    assert "<h2>Fault tolerance</h2>" not in page and "fault tolerance</th>" not in page
    assert FIGURE not in page and not (plain / FIGURE).exists()
