"""DiLoCo's local-update options (``engine/local/diloco.py``) against references, in float64.

Claims, 3 workers with uneven items (a worker with none at some steps):
* synchronous warm-up (``--sync-warmup W``): W steps then H = 1 with Local SGD's outer
  and inner SGD is synchronous SGD on the global batch at every step (<= 1e-12);
  with inner AdamW the W warm-up steps are single-process AdamW on the global batch,
  every replica bitwise identical through them, and the first sync (step W + H) is the
  outer step of a K-worker simulation that starts its global copy at step W;
  a checkpoint taken inside the warm-up continues bit for bit;
* outer-momentum warm-up (``--outer-momentum-warmup K``): the run equals a K-worker
  simulation whose outer SGD sets momentum m * min(1, (k - 1) / K) at its k-th step
  (DiLoCo and Streaming DiLoCo, per fragment);
* a growing H (``--sync-every-max M``): at a constant learning rate it is fixed-H
  DiLoCo bit for bit; under a decaying one the syncs fall at the predicted steps, and a
  resume between two of them keeps the schedule;
* eager updates for streaming (``--sync-eager``): with one worker eager with tau = 1 is
  streaming with tau = 0 bit for bit; with 3 it equals a simulation of the rule with a
  global copy per worker (<= 1e-12), and a resume with an eager sum in flight is exact;
* every option at 0 is today's DiLoCo bit for bit; bad values and wrong modes are
  one-line errors.
"""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.engine.strategy.builders import build_local
from gradsync.engine.strategy.options import SyncOptions
from gradsync.engine.transport import comm
from tests.engine.diloco_helpers import (
    LR,
    SCHED,
    STEPS,
    STREAM,
    TOL,
    build_diloco,
    flat_schedule,
    identical,
    inner_step,
    local_steps,
    reference_local,
    run_diloco,
)
from tests.helpers import (
    SharedSpawn,
    dataset,
    errors_of,
    max_gap,
    mlp,
    mse,
    same_tensors,
    uneven_schedule,
)

WORLD = 3
WARM = 3  # W
WARM_STEPS = 8
MICRO = uneven_schedule(WARM_STEPS, WORLD)  # micro-steps of unequal sizes, a rank with nothing
ADAMW_TOL = 1e-12


def _through_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _inner(kind):
    if kind == "sgd":
        return torch.optim.SGD, {"lr": LR}
    return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}


# ---------------------------------------------------------------- workers
def _warmup_run(sync_kw, inner, cut=None):
    """The strategy ``gradsync train`` builds, driven as its loop drives it: micro-steps
    under no_sync, backward(loss, num_items), inner step, after_step."""
    rank = gs.rank()
    x, y = dataset()
    sync = SyncOptions(method="diloco", **sync_kw)
    cls, kw = _inner(inner)
    st = build_local(mlp(), "fp32", cls, None, sync, **kw)
    trail, syncs, agree = [], [], []
    for s, step in enumerate(MICRO):
        if s == cut:  # through bytes into a fresh strategy with other values
            state = _through_bytes(st.per_rank_state())
            st = build_local(mlp(seed=9), "fp32", cls, None, sync, **kw)
            st.load_per_rank_state(state)
        micros = step[rank]
        for k, idx in enumerate(micros):
            with st.model.no_sync() if k < len(micros) - 1 else contextlib.nullcontext():
                if idx:
                    st.model.backward(mse(st.model(x[idx]), y[idx]), num_items=len(idx))
                else:
                    st.model.backward(None, num_items=0)
        st.optimizer.step()
        st.after_step(0)
        st.optimizer.zero_grad(set_to_none=True)
        trail.append([p.detach().clone() for p in st.module.parameters()])
        syncs.append(st.diloco.stats().syncs)
        agree.append(st.diloco.replicas_agree)
    st.finish()
    return {"trail": trail, "syncs": syncs, "agree": agree,
            "params": [p.detach().clone() for p in st.module.parameters()]}


def _lr_at(s: int, decay: float) -> float:
    """The inner learning rate of step s + 1 (0-based s)."""
    return LR * decay ** s


def _grow_run(cfg, decay, steps, cut=None):
    """DiLoCo with the inner lr set each step; the steps its pseudo-gradients were sent at."""
    rank = gs.rank()
    x, y = dataset()
    model = mlp()
    inner, d = build_diloco(cfg, model)
    sent: list[int] = []

    def observe(phase, ev):
        if phase == "launch" and ev.tag == "diloco":
            sent.append(ev.meta["step"])

    with comm.add_observer(observe):
        for s in range(steps):
            if s == cut:
                saved = _through_bytes({"model": model.state_dict(), "diloco": d.state_dict()})
                model = mlp(seed=9)
                inner, d = build_diloco(cfg, model)
                model.load_state_dict(saved["model"])
                d.load_state_dict(saved["diloco"])
            for g in inner.param_groups:
                g["lr"] = _lr_at(s, decay)
            idx = SCHED[WORLD][s][rank]
            inner_step(model, inner, x, y, idx)
            d.step(num_items=len(idx))
        d.sync_now()
    return {"params": [p.detach().clone() for p in model.parameters()], "sent": sent,
            "stats": d.stats()}


def _bad_input():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return errors_of(
        warmup=lambda: gs.DiLoCo(model, opt, warmup_steps=-1),
        ramp=lambda: gs.DiLoCo(model, opt, outer_momentum_warmup=1.5),
        every_max=lambda: gs.DiLoCo(model, opt, sync_every=4, sync_every_max=3),
        no_momentum=lambda: gs.DiLoCo(model, opt, lambda ps: torch.optim.Adam(ps),
                                      outer_momentum_warmup=2),
        load=lambda: gs.DiLoCo(model, opt, sync_every=4, warmup_steps=2).load_state_dict(
            gs.DiLoCo(model, opt, sync_every=4).state_dict()),
        eager=lambda: gs.StreamingDiLoCo(model, opt, sync_every=4, delay=0, eager=True))


RAMP = {"H": 2, "outer": "nesterov", "outer_momentum_warmup": 3}
RAMP_STREAM = {**STREAM, "outer_momentum_warmup": 2}
PLAIN = {"H": 2, "outer": "nesterov"}
ZEROS = {**PLAIN, "warmup_steps": 0, "outer_momentum_warmup": 0, "sync_every_max": 0}
GROW = {**PLAIN, "sync_every_max": 8}
DECAY = 0.7
DP_AFTER_WARMUP = {"every": 1, "warmup": WARM, "outer_lr": 1.0, "outer_momentum": 0.0}
LOCAL_AFTER_WARMUP = {"every": 4, "warmup": WARM}  # outer: SGD lr 0.7, Nesterov 0.9
STREAM_Q = {**STREAM, "alpha": 0.25}  # F = 2, tau = 1, outer SGD lr 0.5 momentum 0.8
EAGER = {**STREAM_Q, "eager": True}  # alpha not 1/2: alpha and 1 - alpha told apart
STREAM_TAU0 = {**STREAM_Q, "tau": 0}
SCHED_ONE = flat_schedule(STEPS, 1)

JOBS = {
    "warm/sgd": (_warmup_run, (DP_AFTER_WARMUP, "sgd")),
    "warm/adamw": (_warmup_run, (LOCAL_AFTER_WARMUP, "adamw")),
    "warm/adamw/cut": (_warmup_run, (LOCAL_AFTER_WARMUP, "adamw", 2)),
    "ramp": (run_diloco, (RAMP, SCHED[WORLD], STEPS)),
    "ramp_stream": (run_diloco, (RAMP_STREAM, SCHED[WORLD], STEPS)),
    "plain": (run_diloco, (PLAIN, SCHED[WORLD], STEPS)),
    "zeros": (run_diloco, (ZEROS, SCHED[WORLD], STEPS)),
    "grow/fixed": (_grow_run, (PLAIN, 1.0, STEPS)),
    "grow/const": (_grow_run, (GROW, 1.0, STEPS)),
    "grow/decay": (_grow_run, (GROW, DECAY, STEPS)),
    "grow/decay/cut": (_grow_run, (GROW, DECAY, STEPS, 7)),
    "eager": (run_diloco, (EAGER, SCHED[WORLD], STEPS)),
    "eager/cut": (run_diloco, (EAGER, SCHED[WORLD], STEPS, 6)),  # f1 in flight after 6
    "stream": (run_diloco, (STREAM_Q, SCHED[WORLD], STEPS)),
    "bad_input": (_bad_input, ()),
}
SPAWN = SharedSpawn(JOBS, timeout_s=90)
ONE = SharedSpawn({"eager": (run_diloco, (EAGER, SCHED_ONE, STEPS)),
                   "tau0": (run_diloco, (STREAM_TAU0, SCHED_ONE, STEPS)),
                   "tau1": (run_diloco, (STREAM_Q, SCHED_ONE, STEPS))}, timeout_s=60)


def _results(name):
    return SPAWN.results(name, WORLD)


# ---------------------------------------------------------------- references
def _global(step):
    return [i for rank in step for micro in rank for i in micro]


def _reference_synchronous(inner, steps):
    """One process, the global batch of each step: the trail of parameters."""
    x, y = dataset()
    model = mlp()
    cls, kw = _inner(inner)
    opt = cls(model.parameters(), **kw)
    trail = []
    for step in MICRO[:steps]:
        inner_step(model, opt, x, y, _global(step))
        trail.append([p.detach().clone() for p in model.parameters()])
    return model, opt, trail


def _reference_first_sync_after_warmup(H):
    """W synchronous AdamW steps, then WORLD copies of model and optimizer take H local
    steps on their own items, then DiLoCo's Nesterov outer step from the step-W copy."""
    x, y = dataset()
    model, opt, _ = _reference_synchronous("adamw", WARM)
    anchors = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    outer = torch.optim.SGD(anchors, lr=0.7, momentum=0.9, nesterov=True)
    workers = [copy.deepcopy((model, opt)) for _ in range(WORLD)]
    items = [0] * WORLD
    for step in MICRO[WARM:WARM + H]:
        for r, (m, o) in enumerate(workers):
            idx = [i for micro in step[r] for i in micro]
            inner_step(m, o, x, y, idx)
            items[r] += len(idx)
    with torch.no_grad():
        for j, a in enumerate(anchors):
            a.grad = sum(n * (a - list(m.parameters())[j])
                         for n, (m, _) in zip(items, workers)) / sum(items)
    outer.step()
    return [a.detach().clone() for a in anchors]


def _reference_eager(sched, steps, world, cfg, frags):
    """Streaming DiLoCo with eager updates, K workers in one process, each with its own
    global copy and outer SGD per fragment (they differ while a stand-in step is out)."""
    x, y = dataset()
    H, tau, alpha = cfg["H"], cfg["tau"], cfg["alpha"]
    models = [mlp() for _ in range(world)]
    inners = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    params = [list(m.parameters()) for m in models]
    anchors = [[nn.Parameter(p.detach().clone()) for p in params[0]] for _ in range(world)]
    outers = [[torch.optim.SGD([anchors[r][j] for j in f], lr=0.5, momentum=0.8) for f in frags]
              for r in range(world)]
    F = len(frags)
    offsets = [f * H // F for f in range(F)]
    items = [[0.0] * world for _ in frags]
    prev = [[None] * world for _ in frags]
    last_sent, inflight = [0] * F, []

    def outer_step(r, f, g, total):
        if total > 0:
            for j, gj in zip(frags[f], g):
                anchors[r][j].grad = gj / total
            outers[r][f].step()
            for j in frags[f]:
                anchors[r][j].grad = None

    def merge(r, f, a):
        for j in frags[f]:
            p = params[r][j]
            p.copy_(a * p + (1 - a) * anchors[r][j] if a else anchors[r][j])

    def send(f, s, eager):
        own = [[items[f][r] * (anchors[r][j] - params[r][j]) for j in frags[f]]
               for r in range(world)]
        n = items[f]
        items[f], last_sent[f] = [0.0] * world, s
        summed, total = [sum(o[k] for o in own) for k in range(len(frags[f]))], sum(n)
        if not eager:
            for r in range(world):
                outer_step(r, f, summed, total)
                merge(r, f, 0.0)
            return
        saved, stand_in = [], []
        for r in range(world):
            est, est_n = own[r], n[r]
            if prev[f][r] is not None:
                s_prev, n_prev, own_prev, own_n_prev = prev[f][r]
                est = [e + (a - b) for e, a, b in zip(est, s_prev, own_prev)]
                est_n = est_n + (n_prev - own_n_prev)
            saved.append(([anchors[r][j].clone() for j in frags[f]],
                          copy.deepcopy(outers[r][f].state_dict())))
            outer_step(r, f, est, est_n)
            stand_in.append([anchors[r][j].clone() for j in frags[f]])
            merge(r, f, alpha)
        inflight.append((s + tau, f, own, n, summed, total, saved, stand_in))

    def finish(job):
        _, f, own, n, summed, total, saved, stand_in = job
        inflight.remove(job)
        for r in range(world):
            for j, v in zip(frags[f], saved[r][0]):
                anchors[r][j].copy_(v)
            outers[r][f].load_state_dict(saved[r][1])
            outer_step(r, f, summed, total)
            for j, st in zip(frags[f], stand_in[r]):
                params[r][j].add_((anchors[r][j] - st) * (1 - alpha))
            prev[f][r] = (summed, total, own[r], n[r])

    for s in range(1, steps + 1):
        local_steps(models, inners, x, y, sched[s - 1], items)
        with torch.no_grad():
            for job in [j for j in inflight if j[0] <= s]:
                finish(job)
            for f in range(F):
                if (s - offsets[f]) % H == 0:
                    send(f, s, eager=True)
    with torch.no_grad():
        for job in list(inflight):
            finish(job)
        for f in range(F):
            if last_sent[f] != steps:
                send(f, steps, eager=False)
            else:
                for r in range(world):
                    merge(r, f, 0.0)
    return [p.detach().clone() for p in params[0]]


class RampSGD(torch.optim.SGD):
    """The ramp written out: the k-th step's momentum is m * min(1, (k - 1) / K)."""

    def __init__(self, params, K, **kw):
        super().__init__(params, **kw)
        self.K, self.k, self.m = K, 0, kw["momentum"]

    def step(self, closure=None):
        self.k += 1
        for g in self.param_groups:
            g["momentum"] = self.m * min(1.0, (self.k - 1) / self.K)
        return super().step(closure)


# ---------------------------------------------------------------- synchronous warm-up
def test_warmup_then_h1_is_synchronous_sgd_at_every_step():
    res = _results("warm/sgd")
    _, _, ref = _reference_synchronous("sgd", WARM_STEPS)
    assert any(not _global([step[-1]]) for step in MICRO)  # a worker with nothing, some step
    for s in range(WARM_STEPS):
        for r in range(1, WORLD):
            assert same_tensors(res[0]["trail"][s], res[r]["trail"][s]), (s, r)
        gap = max_gap(res[0]["trail"][s], ref[s])
        assert gap <= TOL, f"step {s + 1}: gap {gap:.3e}"


def test_warmup_steps_are_synchronous_adamw_then_local_steps_start_from_there():
    res = _results("warm/adamw")
    _, _, ref = _reference_synchronous("adamw", WARM)
    for s in range(WARM):  # the warm-up: one model, single-process AdamW's
        for r in range(1, WORLD):
            assert same_tensors(res[0]["trail"][s], res[r]["trail"][s]), (s, r)
        gap = max_gap(res[0]["trail"][s], ref[s])
        assert gap <= ADAMW_TOL, f"step {s + 1}: gap {gap:.3e}"
    assert not same_tensors(res[0]["trail"][WARM], res[1]["trail"][WARM])  # local steps
    H = LOCAL_AFTER_WARMUP["every"]
    assert res[0]["syncs"] == [0] * (WARM + H - 1) + [1] * (WARM_STEPS - WARM - H + 1)
    # where `gradsync train` checks replicas for drift: warm-up steps and sync steps
    assert res[0]["agree"] == [True] * WARM + [False] * (H - 1) + [True, False]
    first_sync = WARM + H - 1
    synced = identical([{"params": r["trail"][first_sync]} for r in res], WORLD)
    gap = max_gap(synced, _reference_first_sync_after_warmup(H))
    assert gap <= ADAMW_TOL, f"first sync: gap {gap:.3e}"


def test_a_checkpoint_inside_the_warmup_continues_bit_for_bit():
    plain, cut = _results("warm/adamw"), _results("warm/adamw/cut")
    for r in range(WORLD):
        assert same_tensors(plain[r]["params"], cut[r]["params"]), f"rank {r}"
        assert plain[r]["syncs"] == cut[r]["syncs"]


# ---------------------------------------------------------------- outer momentum warm-up
@pytest.mark.parametrize("name,cfg,frags", [
    ("ramp", RAMP, None), ("ramp_stream", RAMP_STREAM, [[0, 1], [2, 3, 4, 5]])])
def test_outer_momentum_ramp_matches_a_simulation_with_the_ramp_written_out(name, cfg, frags):
    params = identical(_results(name), WORLD)
    lr, m = (0.7, 0.9) if cfg["outer"] == "nesterov" else (0.5, 0.8)
    ramp = lambda ps: RampSGD(ps, cfg["outer_momentum_warmup"], lr=lr, momentum=m,
                              nesterov=cfg["outer"] == "nesterov")
    gap = max_gap(params, reference_local(SCHED[WORLD], STEPS, WORLD, cfg, frags, ramp))
    assert gap <= TOL, f"gap {gap:.3e}"
    plain = reference_local(SCHED[WORLD], STEPS, WORLD, cfg, frags)
    assert max_gap(params, plain) > 1e-6  # the ramp changed the run


def test_every_option_at_zero_is_todays_diloco_bit_for_bit():
    assert same_tensors(identical(_results("zeros"), WORLD), identical(_results("plain"), WORLD))


# ---------------------------------------------------------------- a growing H
def test_growing_h_at_a_constant_learning_rate_is_fixed_h():
    fixed, grown = _results("grow/fixed"), _results("grow/const")
    assert fixed[0]["sent"] == grown[0]["sent"] == list(range(2, STEPS + 1, 2))
    assert same_tensors(identical(fixed, WORLD), identical(grown, WORLD))


def test_growing_h_syncs_at_the_predicted_steps_and_resumes_between_them():
    """lr_s = LR 0.7^(s-1), peak LR, H = 2, M = 8: after step 2 the interval is
    floor(2 / 0.7 + 1/2) = 3; after step 5 floor(2 / 0.7^4 + 1/2) = 8; after 13 capped at 8;
    step 14 is sync_now's."""
    plain, cut = _results("grow/decay"), _results("grow/decay/cut")
    assert plain[0]["sent"] == [2, 5, 13, 14]
    for r in range(WORLD):
        assert cut[r]["sent"] == [2, 5, 13, 14]  # the resumed object kept the schedule
        assert same_tensors(plain[r]["params"], cut[r]["params"]), f"rank {r}"
        assert plain[r]["stats"] == cut[r]["stats"]


# ---------------------------------------------------------------- eager updates
def test_eager_with_one_worker_is_streaming_with_no_delay_bit_for_bit():
    """One worker has no others: the stand-in is the average, the correction zero."""
    eager, tau0, tau1 = (ONE.results(n, 1)[0]["params"] for n in ("eager", "tau0", "tau1"))
    assert same_tensors(eager, tau0)
    assert max_gap(tau1, tau0) > 1e-6  # the delay itself changes the run


def test_eager_matches_a_k_worker_simulation_and_resumes_in_flight():
    params = identical(_results("eager"), WORLD)
    frags = [[0, 1], [2, 3, 4, 5]]
    gap = max_gap(params, _reference_eager(SCHED[WORLD], STEPS, WORLD, EAGER, frags))
    assert gap <= TOL, f"gap {gap:.3e}"
    assert max_gap(params, identical(_results("stream"), WORLD)) > 1e-6  # not plain streaming
    for plain, cut in zip(_results("eager"), _results("eager/cut")):
        assert same_tensors(plain["params"], cut["params"])
        assert plain["stats"] == cut["stats"]


# ---------------------------------------------------------------- bad input, modes
def test_bad_values_are_one_line_errors_on_every_rank():
    expected = {"warmup": "warmup_steps must be an int >= 0",
                "ramp": "outer_momentum_warmup must be an int >= 0",
                "every_max": "sync_every_max (3) must be 0",
                "no_momentum": "Adam has none", "load": "saved with",
                "eager": "they need delay >= 1"}
    for rank in _results("bad_input"):
        assert list(rank) == list(expected)
        for name, words in expected.items():
            msg = rank[name]
            assert msg is not None and words in msg and "\n" not in msg, (name, msg)


@pytest.mark.parametrize("kw,words", [
    ({"sync_warmup": 3}, "--sync-warmup 3 has no effect with --sync exact: it needs --sync "
                         "diloco or --sync streaming-diloco"),
    ({"outer_momentum_warmup": 2}, "--outer-momentum-warmup 2 has no effect with --sync exact"),
    ({"sync_every_max": 50}, "--sync-every-max 50 has no effect with --sync exact: it needs "
                             "--sync diloco"),
    ({"sync": "streaming-diloco", "sync_every": 4, "sync_every_max": 8},
     "--sync-every-max needs --sync diloco"),
    ({"sync": "diloco", "sync_every_max": 10}, "--sync-every-max (10) must be 0 (H fixed) or at "
                                               "least --sync-every (25)"),
    ({"sync": "diloco", "sync_warmup": -1}, "--sync-warmup must be an integer >= 0"),
    ({"sync_eager": True}, "--sync-eager True has no effect with --sync exact: it needs --sync "
                           "streaming-diloco"),
    ({"sync": "streaming-diloco", "sync_delay": 0, "sync_eager": True}, "--sync-eager stands in"),
    ({"sync": "diloco", "sync_warmup": 5, "ft_groups": 2},
     "--sync-warmup 5 does not combine with --ft-groups"),
])
def test_wrong_mode_or_value_is_refused_in_one_line(kw, words):
    with pytest.raises(gs.GradsyncError) as e:
        gs.TrainConfig(out="x", **kw)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_flags_reach_the_sync_options():
    cfg = gs.TrainConfig(out="x", sync="diloco", sync_every=4, sync_warmup=3,
                         outer_momentum_warmup=2, sync_every_max=16)
    opts = cfg.sync_options()
    assert (opts.warmup, opts.momentum_warmup, opts.every_max) == (3, 2, 16)
    gs.TrainConfig(out="x", sync="streaming-diloco", sync_warmup=3, outer_momentum_warmup=2)


def test_gradsync_train_runs_the_options_and_checks_replicas_where_they_agree(tmp_path):
    """The one run of the loop: the flags reach DiLoCo, the warm-up steps send gradients
    (bytes on every step), and the drift check after every step that syncs or warms up
    (--drift-every 1) finds the replicas identical also where a grown H put the syncs
    off the multiples of --sync-every (a check there would fail)."""
    import json

    from gradsync.rundir import DRIFT, METRICS, read_metrics

    out = tmp_path / "run"
    gs.train(gs.TrainConfig(
        workers=2, steps=10, global_batch=12, micro_batch=2, lr=0.05, warmup=1,
        optimizer="sgd", out=str(out), clip=0.0, checkpoint_every=0, eval_every=0,
        drift_every=1, no_report=True, seed=0, timeout=60, model="tests.train.factories:tiny64",
        data="tests.train.factories:regression64", sync="diloco", sync_every=2, sync_warmup=3,
        outer_momentum_warmup=2, sync_every_max=6))
    rows = read_metrics(str(out / METRICS))[0]
    sent = [m["sent_bytes"] for m in rows]
    assert len(sent) == 10 and all(sent[:3]) and sent[3] == 0, sent  # step 4: local, no sync
    # metrics say where the replicas are one model (a held-out loss there is one model's):
    # the warm-up steps and the syncs, not the local steps between
    one_model = [m["one_model"] for m in rows]
    assert one_model[:9] == [True] * 3 + [bool(b) for b in sent[3:9]], (one_model, sent)
    syncs = [s + 1 for s in range(3, 9) if sent[s]]  # steps after the warm-up that synced
    assert syncs[0] == 5 and any(s % 2 for s in syncs), syncs  # H = 2 from step 3, then grown
    drift = json.loads((out / DRIFT).read_text())
    assert drift["ok"] and drift["checks"] == 3 + len(syncs) + 1, drift  # warm-up, syncs, end
