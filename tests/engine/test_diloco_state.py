"""DiLoCo's state and traffic: checkpoints, compression, bytes per step, buffers, bad input.

Claims: state_dict round trips mid-interval (AdamW inner state, Nesterov outer state,
int8 residuals, a streaming reduction in flight) continue bit for bit; int8
pseudo-gradients stay close to exact ones and report their ratio; Streaming DiLoCo
sends 1/F of DiLoCo's bytes at its busiest step (counted by a comm observer); buffers
are item-weighted averages; bad arguments are one-line errors on every rank.
Against single-process simulations: ``test_diloco.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.engine.transport import comm
from tests.engine.diloco_helpers import (
    LR,
    RESUME,
    RESUME_INT8,
    RESUME_STREAM,
    SCHED,
    STEPS,
    build_diloco,
    identical,
    inner_step,
    run_diloco,
)
from tests.helpers import SharedSpawn, dataset, errors_of, mlp, same_tensors


def _bytes_per_step(cfg, steps):
    """Pseudo-gradient bytes by the step they were sent at, seen by a comm observer."""
    per_step: dict[int, int] = {}

    def observe(phase, ev):
        if phase == "launch" and ev.tag == "diloco":
            per_step[ev.meta["step"]] = per_step.get(ev.meta["step"], 0) + ev.nbytes

    model = _equal_blocks()
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(gs.rank()))
    inner, d = build_diloco(cfg, model)
    with comm.add_observer(observe):
        for _ in range(steps):
            model(x).pow(2).mean().backward()
            inner.step()
            inner.zero_grad()
            d.step(num_items=4)
    return per_step


def _equal_blocks(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)]).double()


def _bn_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()


def _buffers_averaged():
    """Running statistics after a sync are the item-weighted average of the replicas'."""
    rank = gs.rank()
    x, y = dataset()
    model = _bn_model()
    inner, d = build_diloco({"H": 2, "outer": "local"}, model)
    sizes = [3 + 2 * rank, 4 + 3 * rank]
    before = None
    for s, n in enumerate(sizes):
        idx = list(range(10 * rank + s, 10 * rank + s + n))
        inner_step(model, inner, x, y, idx)
        if s == 1:
            before = [b.clone() for b in model.buffers()]
        d.step(num_items=n)
    return {"items": sum(sizes), "before": before, "after": [b.clone() for b in model.buffers()]}


def _bad_input():
    """Every rank raises the same one-line error; no rank hangs."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return errors_of(
        sync_every=lambda: gs.DiLoCo(model, opt, sync_every=0),
        inner_optimizer=lambda: gs.DiLoCo(model, "sgd"),
        compress=lambda: gs.DiLoCo(model, opt, compress="zip"),
        delay=lambda: gs.StreamingDiLoCo(model, opt, sync_every=4, delay=4),
        alpha=lambda: gs.StreamingDiLoCo(model, opt, alpha=1.0),
        fragments=lambda: gs.StreamingDiLoCo(model, opt, fragments=99),
        model_differs=lambda: gs.DiLoCo(mlp(hidden=12 + gs.rank()), opt),
        num_items=lambda: gs.DiLoCo(model, opt).step(num_items=-1),
        load=lambda: gs.DiLoCo(model, opt, sync_every=3).load_state_dict(
            gs.DiLoCo(model, opt, sync_every=4).state_dict()),
        outer_misses_parameters=lambda: gs.DiLoCo(
            model, opt, torch.optim.SGD(list(model.parameters())[:1])))


JOBS = {"resume": (run_diloco, (RESUME, SCHED[2], STEPS)),
        "resume/cut": (run_diloco, (RESUME, SCHED[2], STEPS, 6)),
        "resume_int8": (run_diloco, (RESUME_INT8, SCHED[2], STEPS)),
        "resume_int8/cut": (run_diloco, (RESUME_INT8, SCHED[2], STEPS, 6)),
        "resume_stream": (run_diloco, (RESUME_STREAM, SCHED[2], STEPS)),
        "resume_stream/cut": (run_diloco, (RESUME_STREAM, SCHED[2], STEPS, 6)),
        "bytes/diloco": (_bytes_per_step, ({"H": 8, "outer": "local"}, 16)),
        "bytes/streaming": (_bytes_per_step, (
            {"H": 8, "outer": "local", "F": 4, "tau": 0, "alpha": 0.0}, 16)),
        "buffers": (_buffers_averaged, ()), "bad_input": (_bad_input, ())}
SPAWN = SharedSpawn(JOBS, timeout_s=60)


def _results(name):
    return SPAWN.results(name, 2)


@pytest.mark.parametrize("run", ["resume", "resume_int8", "resume_stream"])
def test_resume_mid_interval_continues_bit_for_bit(run):
    """AdamW inner state, Nesterov outer state, int8 residuals, a streaming reduction in flight."""
    plain, cut = _results(run), _results(f"{run}/cut")
    for r in range(2):
        assert len(plain[r]["params"]) == len(list(mlp().parameters()))
        assert same_tensors(plain[r]["params"], cut[r]["params"]), f"rank {r}"
        assert plain[r]["stats"] == cut[r]["stats"]


def test_compressed_pseudo_gradients_stay_close_and_report_their_ratio():
    exact, st_exact = _results("resume")[0]["params"], _results("resume")[0]["stats"]
    int8 = identical(_results("resume_int8"), 2)
    st_int8 = _results("resume_int8")[0]["stats"]
    cos, rel = gs.gradient_distance(int8, exact)
    assert 0 < rel < 1e-2, rel  # compressed, so not bitwise the exact run, but close
    assert st_exact.ratio == pytest.approx(1.0)
    assert st_int8.ratio > 5, st_int8  # float64 pseudo-gradients: 8 bytes -> 1 (+ scales)
    assert st_int8.syncs == st_exact.syncs == 4  # steps 4, 8, 12 and sync_now at 14


def test_streaming_peak_bytes_per_step_drop_by_fragments():
    diloco, streaming = _results("bytes/diloco")[0], _results("bytes/streaming")[0]
    assert sorted(diloco) == [8, 16]
    assert sorted(streaming) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert max(diloco.values()) == 4 * max(streaming.values())
    assert sum(diloco.values()) == sum(streaming.values())


def test_buffers_are_item_weighted_averages():
    res = _results("buffers")
    total = sum(r["items"] for r in res)
    after0 = res[0]["after"]
    assert len(after0) == 3 and all(len(r["before"]) == len(r["after"]) == 3 for r in res)
    for k, after in enumerate(after0):  # running_mean, running_var, num_batches_tracked
        if after.is_floating_point():
            expect = sum(r["items"] * r["before"][k] for r in res) / total
            torch.testing.assert_close(after, expect, rtol=1e-12, atol=1e-14)
        else:
            assert torch.equal(after, res[0]["before"][k])
        assert all(torch.equal(after, r["after"][k]) for r in res)


def test_bad_input_is_a_one_line_error_on_every_rank():
    res = _results("bad_input")
    expected = {"sync_every": "sync_every", "inner_optimizer": "inner_optimizer",
                "compress": "unknown compression", "delay": "delay", "alpha": "alpha",
                "fragments": "fragments", "model_differs": "differs across ranks",
                "num_items": "num_items", "load": "sync_every=4",
                "outer_misses_parameters": "must hold every trainable parameter"}
    for rank in res:
        assert list(rank) == list(expected)
        for name, word in expected.items():
            msg = rank[name]
            assert msg is not None and word in msg and "\n" not in msg, (name, msg)
    for name in list(expected)[:6]:  # the same words everywhere (later ones name the rank)
        assert res[0][name] == res[1][name], name
