"""Sharded corners a user hits outside the training step (2 gloo ranks, float64).

* ``gs.clip_grad_norm_(model)`` on a DataParallel whose gradients ZeRO shards clips
  exactly as ``gs.clip_grad_norm_(zero_optimizer)`` (it used to see no gradient and
  return 0); a plain torch optimizer is a one-line error naming what to pass;
* ``ZeroOptimizer.add_param_group`` after construction is a one-line error (the
  shards are fixed; the group would never train);
* under FSDP, a wrapped layer's weight read between steps is a meta tensor of its
  shape (never a view of freed storage, which crashed the process);
* ZeRO with bf16 parameters and fp32 masters: weights loaded into the model after
  the optimizer was built reach the masters (at full precision), so a step with
  lr 0 keeps them (it used to write the old masters back);
* ranks that build the same model with different settings deciding the collectives
  (a bucket cap, a ZeRO stage, FSDP units) get one error naming the setting on every
  rank, not a backend abort on mismatched message sizes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync as gs
from tests.helpers import (
    SharedSpawn,
    dataset,
    errors_of,
    mlp,
    mse,
    same_tensors,
)


def _clip(target_is_model: bool):
    x, y = dataset()
    model = gs.DataParallel(mlp())
    opt = gs.ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.1)
    norms = []
    for step in range(3):
        idx = slice(8 * step + 4 * gs.rank(), 8 * step + 4 * gs.rank() + 4)
        model.backward(mse(model(x[idx]), y[idx]), num_items=4)
        norms.append(float(gs.clip_grad_norm_(model if target_is_model else opt, 0.05)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "params": [p.detach().clone() for p in model.parameters()]}


def _errors():
    model = gs.DataParallel(mlp())
    opt = gs.ZeroOptimizer(model, torch.optim.SGD, stage=1, lr=0.1)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    return errors_of(add_param_group=lambda: opt.add_param_group({"params": [extra]}),
                     clip_an_optimizer=lambda: gs.clip_grad_norm_(
                         torch.optim.SGD([extra], lr=0.1), 1.0))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _fsdp_weight_between_steps():
    torch.manual_seed(0)
    model = gs.FullyShardedDataParallel(nn.Sequential(Block(), Block()).double(),
                                        wrap={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 5, dtype=torch.float64)).pow(2).mean().backward()
    opt.step()
    w = model.module[0].lin.weight
    return {"device": w.device.type, "shape": tuple(w.shape), "repr": repr(w)}


def _load_after_building(stage):
    model = gs.DataParallel(mlp().float())
    opt = gs.ZeroOptimizer(model, torch.optim.SGD, stage=stage,
                           mixed_precision=gs.MixedPrecision(), lr=0.0)
    pretrained = {k: v.float() for k, v in mlp(seed=7).state_dict().items()}
    model.load_state_dict(pretrained)
    x, y = dataset()
    model.backward(mse(model(x[:4].float()).float(), y[:4].float()), num_items=4)
    opt.step()
    name_of = {id(p): n for n, p in model.module.named_parameters()}
    masters = [{"params": [name_of[id(p)] for p in sh.bucket.params],
                "master": sh.master.detach().clone()} for sh in opt.shards]
    return {"state": {k: v.float() for k, v in model.module.state_dict().items()},
            "pretrained": pretrained, "masters": masters}


def _bf16_batchnorm(kind):
    """A BatchNorm model in bf16 on every strategy: its running statistics follow the
    weight into the compute dtype (fp32 statistics beside a bf16 weight are an error)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    mp = gs.MixedPrecision()
    if kind == "fsdp":
        model = gs.FullyShardedDataParallel(net, mixed_precision=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model = gs.DataParallel(net)
        opt = (gs.MixedPrecisionOptimizer(model, torch.optim.SGD, mp, lr=0.1) if kind == "ddp"
               else gs.ZeroOptimizer(model, torch.optim.SGD, stage=2, mixed_precision=mp,
                                     lr=0.1))
    for step in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step + 10 * gs.rank()))
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [{"dtype": b.dtype, "finite": bool(torch.isfinite(b.float()).all())}
            for b in net.buffers() if b.is_floating_point()]


def _different_setups():
    r = gs.rank()
    return errors_of(bucket_cap_mb=lambda: gs.DataParallel(
                         mlp(), bucket_cap_mb=25 if r == 0 else 1e-4),
                     stage=lambda: gs.ZeroOptimizer(gs.DataParallel(mlp()), torch.optim.SGD,
                                                    stage=1 + r, lr=0.1),
                     units=lambda: gs.FullyShardedDataParallel(
                         nn.Sequential(Block(), Block()).double(),
                         wrap={Block} if r == 0 else {nn.Linear}))


JOBS = {"clip/model": (_clip, (True,)), "clip/optimizer": (_clip, (False,)),
        "errors": (_errors, ()), "fsdp_weight": (_fsdp_weight_between_steps, ()),
        "different_setups": (_different_setups, ()),
        "load/zero1": (_load_after_building, (1,)), "load/zero2": (_load_after_building, (2,)),
        "bf16_batchnorm/ddp": (_bf16_batchnorm, ("ddp",)),
        "bf16_batchnorm/zero2": (_bf16_batchnorm, ("zero2",)),
        "bf16_batchnorm/fsdp": (_bf16_batchnorm, ("fsdp",))}


SPAWN = SharedSpawn(JOBS, timeout_s=90)


def _results(name):
    return SPAWN.results(name, 2)


def test_clip_through_the_model_is_the_zero_optimizers_clip():
    by_model, by_opt = _results("clip/model"), _results("clip/optimizer")
    for m, o in zip(by_model, by_opt, strict=True):
        assert len(m["norms"]) == 3 and m["norms"] == o["norms"]
        assert all(n > 0.05 for n in m["norms"])  # clipping engaged every step
        assert same_tensors(m["params"], o["params"])


def test_add_param_group_and_clip_on_an_optimizer_are_one_line_errors():
    for errors in _results("errors"):
        add, clip = errors["add_param_group"], errors["clip_an_optimizer"]
        assert add and "add_param_group" in add and "\n" not in add
        assert clip and "pass the model" in clip


def test_fsdp_weight_between_steps_is_a_meta_tensor_of_its_shape():
    for res in _results("fsdp_weight"):
        assert res["device"] == "meta" and res["shape"] == (5, 5) and "meta" in res["repr"]


def test_settings_that_differ_across_ranks_are_named_on_every_rank():
    ranks = _results("different_setups")
    assert ranks[0] == ranks[1]
    assert list(ranks[0]) == ["bucket_cap_mb", "stage", "units"]
    for word, msg in ranks[0].items():
        assert msg and word in msg and "differs across ranks" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_bf16_zero_keeps_weights_loaded_after_it_was_built(stage):
    ranks = _results(f"load/{stage}")
    for res in ranks:
        assert list(res["state"]) == list(res["pretrained"])
        for k, v in res["pretrained"].items():
            assert torch.equal(res["state"][k], v.bfloat16().float()), k  # loaded, rounded once
    pretrained = ranks[0]["pretrained"]
    masters = ranks[0]["masters"]
    assert masters and all(len(r["masters"]) == len(masters) for r in ranks)
    for k, shard in enumerate(masters):  # the masters are the fp32 values, unrounded
        flat = torch.cat([r["masters"][k]["master"] for r in ranks])
        expect = torch.cat([pretrained[n].reshape(-1) for n in shard["params"]])
        assert flat.dtype == torch.float32
        assert torch.equal(flat[:expect.numel()], expect)


@pytest.mark.parametrize("kind", ["ddp", "zero2", "fsdp"])
def test_bf16_trains_a_batchnorm_model(kind):
    for buffers in _results(f"bf16_batchnorm/{kind}"):
        assert len(buffers) == 2  # running_mean, running_var
        assert all(b["dtype"] == torch.bfloat16 and b["finite"] is True for b in buffers)
