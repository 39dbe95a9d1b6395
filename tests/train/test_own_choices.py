"""Your own training choices through the same loop (issue 22, point 3).

Three real launches of ``gs.train`` (2 workers, float64), checked against a
single-process float64 reference over each step's whole global batch:

* ``ddp``: a user's optimizer factory given as a function and a scheduler
  factory by name, ``--weight-decay`` on weights only (biases and the LayerNorm
  get 0), clipping off by default, eval metrics, and callbacks -- stopped after
  step 2 and continued, so the user's scheduler and the groups survive a resume;
* ``zero2``: the built-in adamw with ``--weight-decay``/``--betas`` and ``--clip``,
  the groups resolved to this rank's shard pieces.

The rest are in-process unit tests of the rules and the one-line refusals.
"""

import json
import os
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.factory import load_factory
from gradsync.rundir import METRICS, read_metrics
from gradsync.train.launcher.api import take_factories
from gradsync.train.records.callbacks import check_callbacks
from gradsync.train.task.eval_metrics import check_metrics, metric_sums
from gradsync.train.task.optim import own_scheduler, split_decay
from gradsync.train.task.schedule import lr_factor
from tests.train.factories import abs_error, normed64, positive, tensors, user_adamw
from tests.train.test_world_size import _stream

STEPS, GB, MB, LR = 4, 12, 3, 0.05
NO_DECAY = ("inp.bias", "norm.weight", "norm.bias", "out.bias")


class Recorder(gs.Callback):
    """Appends one JSON line per call to ``path`` (the worker's copy writes it)."""

    def __init__(self, path):
        self.path = str(path)

    def _write(self, hook, info, **more):
        with open(self.path, "a") as f:
            f.write(json.dumps({"hook": hook, "rank": os.environ.get("RANK"), "step": info.step,
                                "loss": info.loss, "lr": info.lr, "eval_loss": info.eval_loss,
                                "eval_metrics": info.eval_metrics, **more}) + "\n")

    def on_step_end(self, info):
        path = os.path.join(info.out, "checkpoint.pt")  # the step's own save comes after
        ckpt = torch.load(path, weights_only=False)["step"] if os.path.exists(path) else None
        self._write("step", info, line=info.record["step"], ckpt=ckpt)

    def on_eval(self, info):
        self._write("eval", info)

    def on_checkpoint(self, info):
        saved = torch.load(info.checkpoint, weights_only=False)["step"]
        self._write("checkpoint", info, saved=saved)


def _cfg(out, **kw):
    return gs.TrainConfig(workers=2, steps=STEPS, global_batch=GB, micro_batch=MB, lr=LR,
                          model="tests.train.factories:normed64", out=str(out),
                          data="tests.train.factories:regression64_metrics", drift_every=0,
                          no_report=True, seed=0, timeout=60, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    calls = root / "calls.jsonl"
    own = dict(scheduler="tests.train.factories:halving", weight_decay=0.2, eval_every=2,
               checkpoint_every=2)
    stop = gs.FaultInjector().fail_at(None, 2, "stop")
    assert gs.train(_cfg(root / "a", **own), optimizer=user_adamw, faults=stop,
                    callbacks=[Recorder(calls)]) is None
    gs.train(_cfg(root / "a", **own), optimizer=user_adamw, callbacks=[Recorder(calls)])
    gs.train(_cfg(root / "b", strategy="zero2", optimizer="adamw", weight_decay=0.3,
                  betas="0.85,0.9", clip=0.5, warmup=1, eval_every=0, checkpoint_every=0))
    return root


def _reference(make_opt, clip=None, sched=None):
    """Losses, learning rates, grad norms and the model after each step, one process."""
    torch.manual_seed(0)
    model = normed64()
    x, y = tensors()
    decay = [p for n, p in model.named_parameters() if n not in NO_DECAY]
    rest = [p for n, p in model.named_parameters() if n in NO_DECAY]
    opt = make_opt(decay, rest)
    sched = sched(opt)
    order, losses, lrs, norms, states = _stream(STEPS * GB), [], [], [], []
    for j in range(STEPS):
        block = order[j * GB:(j + 1) * GB]
        loss = F.mse_loss(model(x[block]), y[block])
        loss.backward()
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or 1e300)))
        opt.step()
        sched.step()
        opt.zero_grad()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return losses, lrs, norms, states


def _check_run(out, ref):
    losses, lrs, norms, states = ref
    rows = read_metrics(str(out / METRICS))[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert max(abs(r["loss"] - v) for r, v in zip(rows, losses)) <= 1e-12
    assert max(abs(r["grad_norm"] - v) for r, v in zip(rows, norms)) <= 1e-12
    assert [r["lr"] for r in rows] == pytest.approx(lrs, abs=1e-15)
    state = torch.load(out / "checkpoint.pt", weights_only=False)["model"]
    assert max(float((state[k] - v).abs().max()) for k, v in states[-1].items()) <= 1e-12
    return rows, states


@pytest.mark.timeout(300)
def test_user_optimizer_and_scheduler_exact_on_ddp_across_a_resume(runs):
    def make_opt(decay, rest):  # user_adamw's own betas; --weight-decay on the weights only
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.2},
                                  {"params": rest, "weight_decay": 0.0}],
                                 lr=LR, betas=(0.8, 0.99))

    ref = _reference(make_opt, sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5))
    rows, states = _check_run(runs / "a", ref)
    config = json.loads((runs / "a" / "config.json").read_text())
    assert config["optimizer"] == "tests.train.factories:user_adamw"  # what resume compares
    assert config["scheduler"] == "tests.train.factories:halving" and config["clip"] == 0.0
    # eval metrics: exact over the whole held-out set, after steps 2 and 4
    hx, hy = tensors(10, seed=2)
    model = normed64()
    for row, state in ((rows[1], states[1]), (rows[3], states[3])):
        model.load_state_dict(state)
        with torch.no_grad():
            out = model(hx)
        assert abs(row["eval_loss"] - F.mse_loss(out, hy).item()) <= 1e-12
        assert row["eval_metrics"]["mae"] == pytest.approx((out - hy).abs().mean().item(),
                                                           abs=1e-12)
        assert row["eval_metrics"]["sign"] == ((out > 0) == (hy > 0)).double().mean().item()
    assert "eval_metrics" not in rows[0] and "eval_metrics" not in rows[2]


@pytest.mark.timeout(300)
def test_builtin_adamw_flags_and_clip_exact_on_zero2(runs):
    def make_opt(decay, rest):
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.3},
                                  {"params": rest, "weight_decay": 0.0}],
                                 lr=LR, betas=(0.85, 0.9))

    cfg = _cfg("unused", warmup=1)
    _check_run(runs / "b", _reference(make_opt, clip=0.5, sched=lambda o: (
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, cfg.resolved())))))


@pytest.mark.timeout(300)
def test_callbacks_run_on_rank_0_in_order_and_after_a_resume(runs):
    calls = [json.loads(x) for x in (runs / "calls.jsonl").read_text().splitlines()]
    rows = read_metrics(str(runs / "a" / METRICS))[0]
    assert {c["rank"] for c in calls} == {"0"}
    assert [(c["hook"], c["step"]) for c in calls] == [
        ("step", 1), ("step", 2), ("eval", 2), ("checkpoint", 2),  # then stopped, resumed
        ("step", 3), ("step", 4), ("eval", 4), ("checkpoint", 4)]
    for c in calls:
        row = rows[c["step"] - 1]
        assert (c["loss"], c["lr"], c["eval_loss"]) == (row["loss"], row["lr"],
                                                        row.get("eval_loss"))
        assert c["eval_metrics"] == row.get("eval_metrics", {})
    assert [c["saved"] for c in calls if c["hook"] == "checkpoint"] == [2, 4]
    # on_step_end comes before the step's checkpoint is written, on_checkpoint after it
    assert [c["ckpt"] for c in calls if c["hook"] == "step"] == [None, None, 2, 2]


# ------------------------------------------------------------------ in-process rules

class _Gain2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(2, 3))


class MyNorm(_Gain2d):
    """A norm layer by name: even its 2-D parameter is not decayed."""


def test_decay_rule_spares_biases_norms_and_scalars_not_embeddings():
    model = nn.ModuleDict({"emb": nn.Embedding(5, 3), "lin": nn.Linear(3, 3),
                           "ln": nn.LayerNorm(3), "norm": MyNorm(), "plain": _Gain2d()})
    kind = split_decay(model)
    assert {n for n, k in kind.items() if k == "decay"} == {"emb.weight", "lin.weight",
                                                            "plain.scale"}
    assert set(split_decay(normed64())) - {n for n, k in split_decay(normed64()).items()
                                           if k == "decay"} == set(NO_DECAY)


@pytest.fixture()
def one_rank():
    """A process group of one rank, in this process (strategies are built inside one)."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy, precision, sync", [
    ("ddp", "fp32", "exact"), ("ddp", "bf16", "exact"), ("zero1", "fp32", "exact"),
    ("zero2", "bf16", "exact"), ("zero3", "fp32", "exact"), ("ddp", "fp32", "diloco")])
def test_named_groups_reach_every_strategy_in_one_factory_call(one_rank, strategy, precision,
                                                               sync):
    """The groups, by parameter name, are resolved by the engine for every strategy (the
    module's own parameters, bf16's fp32 masters, ZeRO's and FSDP's pieces) and the
    factory is called once, on them."""
    from gradsync.engine.strategy.registry import build_strategy
    from gradsync.train.task.optim import factory_optimizer, named_groups

    model = normed64()
    own = dict(model.named_parameters())
    cfg = gs.TrainConfig(model="tests.train.factories:normed64", data="teacher", out="unused",
                         weight_decay=0.2, betas="0.5,0.6", strategy=strategy,
                         precision=precision, sync=sync).resolved()
    calls = []

    def factory(groups, lr):
        calls.append([len(g["params"]) for g in groups])
        return user_adamw(groups, lr)

    groups = named_groups(model, cfg)
    built = build_strategy(model, strategy, precision,
                           factory_optimizer(factory, "f", 0.1, strategy != "ddp"),
                           sync=cfg.sync.options, param_groups=groups)
    assert calls == [[2, 4]]
    opt = built.optimizer
    assert [(g["name"], g["weight_decay"], g["betas"], len(g["params"]))
            for g in opt.param_groups] == [("decay", 0.2, (0.5, 0.6), 2),
                                           ("no_decay", 0.0, (0.5, 0.6), 4)]
    first = opt.param_groups[0]["params"][0]
    if strategy == "ddp" and precision == "fp32":  # the module's own parameters
        assert first is own[groups[0]["params"][0]]
    elif precision == "bf16":  # fp32 masters (or master slices) of bf16 parameters
        assert first.dtype == torch.float32
        assert all(p.dtype == torch.bfloat16 for p in built.module.parameters())


def test_factory_results_are_checked():
    from gradsync.train.task.optim import factory_optimizer

    model = normed64()
    groups = [{"params": list(model.parameters())}]
    with pytest.raises(UsageError, match="not a torch.optim.Optimizer"):
        factory_optimizer(lambda groups, lr: "not an optimizer", "f", 0.1, False)(groups)
    other = normed64()  # a factory that looks the parameters up itself
    with pytest.raises(UsageError, match="other tensors than the param_groups"):
        factory_optimizer(lambda groups, lr: torch.optim.SGD(other.parameters(), lr), "f",
                          0.1, False)(groups)
    # off by default, as torch DDP, but for the built-in gpt's own recipe
    assert gs.TrainConfig(out="u", model="mlp").clip == 0.0
    assert gs.TrainConfig(out="u", model="tests.train.factories:tiny64",
                          data="tests.train.factories:regression64").clip == 0.0
    assert gs.TrainConfig(out="u").clip == 1.0 and gs.TrainConfig(out="u", clip=0).clip == 0
    lbfgs = factory_optimizer(lambda groups, lr: torch.optim.LBFGS(
        [p for g in groups for p in g["params"]]), "f", 0.1, True)
    with pytest.raises(UsageError, match="cannot run on shards"):
        lbfgs(groups)
    cfg = gs.TrainConfig(out="u")
    with pytest.raises(UsageError, match="not a torch.optim.lr_scheduler"):
        own_scheduler(lambda opt, steps: None, torch.optim.SGD(model.parameters(), 0.1),
                      cfg.resolved(), 10)


@pytest.mark.parametrize("kw, message", [
    ({"betas": "0.9"}, "--betas takes B1,B2"), ({"betas": "0.9,1.5"}, "--betas takes B1,B2"),
    ({"betas": "0.9,0.95", "optimizer": "sgd"}, "sgd .--optimizer sgd., which has none"),
    ({"weight_decay": -1.0}, "--weight-decay must be"),
    ({"scheduler": "cosine"}, "--scheduler takes pkg.module:factory"),
    ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
])
def test_config_refuses_bad_choices(kw, message):
    with pytest.raises(UsageError, match=message):
        gs.TrainConfig(out="u", **kw)


def test_refusals_of_what_cannot_reach_the_workers():
    class Local(gs.Callback):
        pass

    with pytest.raises(UsageError, match="cannot reach the workers"):
        check_callbacks([Local()])
    with pytest.raises(UsageError, match="takes instances"):
        check_callbacks([Recorder])
    with pytest.raises(UsageError, match="has none of on_step_end"):
        check_callbacks([object()])
    assert check_callbacks(Recorder("x"))[0].path == "x"
    with pytest.raises(UsageError, match="optimizer= takes a module-level function"):
        take_factories({"optimizer": lambda groups, lr: None})
    given = {"optimizer": user_adamw, "scheduler": "tests.train.factories:halving"}
    assert take_factories(given) == {"tests.train.factories:user_adamw": user_adamw}
    assert given["optimizer"] == "tests.train.factories:user_adamw"
    assert pickle.loads(pickle.dumps(Recorder("x"))).path == "x"
    with pytest.raises(UsageError, match="--optimizer nowhere:f: cannot import 'nowhere'"):
        load_factory("nowhere:f", "--optimizer", ("param_groups", "lr"))


def test_metrics_need_a_held_out_set_and_return_sum_and_count():
    with pytest.raises(UsageError, match="computed on the held-out set"):
        check_metrics({"mae": abs_error}, None)
    with pytest.raises(UsageError, match="must be a dict"):
        check_metrics([abs_error], [])
    out, y = torch.tensor([[1.0, -2.0]]), torch.tensor([[0.5, 1.0]])
    assert metric_sums({"mae": abs_error, "sign": positive}, out, y) == [3.5, 2.0, 1.0, 2.0]
    with pytest.raises(UsageError, match="returned 0.5; a metric returns"):
        metric_sums({"bad": lambda o, t: 0.5}, out, y)


def test_an_optimizer_factory_by_file_path_loads_like_a_model_factory(tmp_path, monkeypatch):
    """``--optimizer ./f.py:make`` goes through the one factory loader, as ``--model
    ./f.py:build`` does: file paths work, and the hints are the same."""
    from gradsync.train.task.optim import optimizer_factory, scheduler_factory

    (tmp_path / "own_opt_by_path.py").write_text(
        "import torch\n\n\ndef make(param_groups, lr):\n"
        "    return torch.optim.SGD(param_groups, lr=lr)\n\n\ndef one(optimizer):\n"
        "    return None\n")
    monkeypatch.chdir(tmp_path)
    cfg = gs.TrainConfig(out="u", optimizer="./own_opt_by_path.py:make").resolved()
    opt = optimizer_factory(cfg)([{"params": [torch.nn.Parameter(torch.zeros(2))]}], 0.1)
    assert isinstance(opt, torch.optim.SGD)
    here = re.escape(str(tmp_path))  # a relative path is recorded from where it was typed
    with pytest.raises(UsageError, match=rf"^--optimizer {here}/absent\.py:make: cannot import "
                                         rf"'{here}/absent\.py': no such file"):
        optimizer_factory(gs.TrainConfig(out="u", optimizer="./absent.py:make").resolved())
    with pytest.raises(UsageError, match=rf"^--scheduler {here}/own_opt_by_path\.py:one must "
                                         r"take two arguments, optimizer and total_steps"):
        scheduler_factory(gs.TrainConfig(out="u",
                                         scheduler="./own_opt_by_path.py:one").resolved())


def test_a_registered_builder_that_hands_the_groups_on_gets_them_resolved():
    """A strategy registered by a user builds its optimizer as
    ``optimizer_class(module.parameters(), **opt_kwargs)`` (the benchmark's torch-ddp
    anchor does): the named groups it passes on, or drops, are resolved by name."""
    from gradsync.train.task.optim import factory_optimizer, named_groups

    model = normed64()
    cfg = gs.TrainConfig(model="tests.train.factories:normed64", data="teacher", out="unused",
                         weight_decay=0.2).resolved()
    groups = named_groups(model, cfg)
    build = factory_optimizer(user_adamw, "f", 0.1, False, model, groups)
    for opt in (build(model.parameters(), param_groups=groups), build(model.parameters())):
        assert [(g["name"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] \
            == [("decay", 0.2, 2), ("no_decay", 0.0, 4)]
    with pytest.raises(UsageError, match="tensors gradsync cannot name"):
        build([nn.Parameter(torch.zeros(3))], param_groups=groups)
