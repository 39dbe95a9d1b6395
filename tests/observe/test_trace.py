"""The tracer: valid Chrome trace JSON, collectives inside their steps, one span per bucket.

Two real gloo workers train a small MLP for three steps of two micro-steps (the
first under no_sync) with tiny buckets, tracing steps 2 and 3; a ZeRO-style
all-gather is issued inside a traced step to show that any collective through
engine/comm is recorded. Step 1 is untraced: it proves off means off.
"""

import json

import torch

import gradsync as gs
from gradsync.engine.transport import comm, tracing
from gradsync.engine.transport.tracing import Tracer
from gradsync.observe.chrome import chrome_trace, rank_payload
from tests.helpers import dataset, mse

CAP_MB = 0.0002  # ~200 bytes: several buckets for the tiny MLP
STEPS, TRACED = 3, (2, 3)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()


def _worker():
    x, y = dataset()
    rank = gs.rank()
    dp = gs.DataParallel(_model(), bucket_cap_mb=CAP_MB, first_bucket_mb=CAP_MB)
    opt = torch.optim.SGD(dp.parameters(), lr=0.01)
    tracer = Tracer(rank)
    launched_in_no_sync = []
    counting = [False]
    handle = comm.add_observer(
        lambda kind, ev: launched_in_no_sync.append(ev.tag) if counting[0] and kind == "launch"
        else None)
    off_state = []
    for step in range(1, STEPS + 1):
        if step in TRACED:
            tracer.start()
            tracer.begin_step(step)
        else:
            off_state.append((tracing.ACTIVE is None, len(tracer.spans)))
        idx = list(range(rank * 8, rank * 8 + 8))
        with dp.no_sync():
            counting[0] = True
            dp.backward(mse(dp(x[idx[:4]]), y[idx[:4]]), num_items=4)
            counting[0] = False
        dp.backward(mse(dp(x[idx[4:]]), y[idx[4:]]), num_items=4)
        if step == 3:  # a ZeRO-style gather goes through the same door
            out = torch.empty(2 * 4, dtype=torch.float64)
            comm.all_gather_single(out, torch.zeros(4, dtype=torch.float64), tag="zero-params")
        with tracing.span("optimizer"):
            opt.step()
            opt.zero_grad()
        if step in TRACED:
            tracer.end_step()
    tracer.stop()
    handle.remove()
    return {"payload": rank_payload(tracer), "buckets": len(dp.bucket_plan),
            "launched_in_no_sync": launched_in_no_sync, "untraced_steps": off_state,
            "cleaned_up": tracing.ACTIVE is None and not comm._observers}


def test_trace_is_valid_chrome_json_and_collectives_sit_in_their_steps():
    results = gs.spawn(_worker, 2)
    payloads = [r["payload"] for r in results]
    n_buckets = results[0]["buckets"]
    assert n_buckets >= 3
    for res in results:
        assert res["launched_in_no_sync"] == []  # no collective during a no_sync micro-step
        assert res["untraced_steps"] == [(True, 0)]  # step 1: not active, nothing recorded
        assert res["cleaned_up"] is True  # stop() unregisters: the no-tracer path is back

    trace = json.loads(json.dumps(chrome_trace(payloads)))  # strictly JSON-serialisable
    events = trace["traceEvents"]
    assert isinstance(events, list) and trace["displayTimeUnit"] == "ms"
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    xs = [e for e in events if e["ph"] == "X"]
    for e in xs:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and e["ts"] >= 0

    for rank in (0, 1):
        mine = [e for e in xs if e["pid"] == rank]
        steps = {e["args"]["step"]: e for e in mine if e["cat"] == "step"}
        assert sorted(steps) == list(TRACED)
        for s, st in steps.items():
            lo, hi = st["ts"], st["ts"] + st["dur"]
            comm_spans = [e for e in mine if e["cat"] == "comm" and e["args"].get("step") == s]
            for e in comm_spans:  # every collective lies inside its step
                assert lo <= e["ts"] and e["ts"] + e["dur"] <= hi + 1e-3, (e, st)
            buckets = [e for e in comm_spans if e["args"]["tag"].startswith("bucket")]
            assert sorted(e["args"]["bucket"] for e in buckets) == list(range(n_buckets))
            # launched inside the synchronised backward, never in the no_sync one
            bwd = {e["args"]["sync"]: e for e in mine
                   if e["name"] == "backward" and e["args"]["step"] == s}
            assert set(bwd) == {False, True}
            quiet = bwd[False]
            for e in comm_spans:
                assert not quiet["ts"] <= e["ts"] <= quiet["ts"] + quiet["dur"]
            for e in buckets:
                b = bwd[True]
                assert b["ts"] <= e["ts"] <= b["ts"] + b["dur"]
            compute = {e["name"] for e in mine if e["args"].get("step") == s and e["tid"] == 0}
            assert {"forward", "backward", "sync wait", "optimizer"} <= compute
        gathers = [e for e in mine if e["name"] == "all_gather zero-params"]
        assert len(gathers) == 1 and gathers[0]["args"]["step"] == 3
        # collectives on one lane never overlap (Chrome trace needs nesting per thread)
        by_lane = {}
        for e in mine:
            if e["cat"] == "comm":
                by_lane.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        for spans in by_lane.values():
            spans.sort()
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
