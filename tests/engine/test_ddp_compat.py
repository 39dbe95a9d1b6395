"""torch DDP's constructor keywords on gradsync.DataParallel: the same run, or a clear error.

``DataParallel(model, process_group=pg, device_ids=None, output_device=None, dim=0,
gradient_as_bucket_view=..., static_graph=..., init_sync=True)`` trains exactly as
``DataParallel(model, group=pg)`` (on a subgroup, so ``process_group`` is really
used); keywords that would mean something gradsync does not do are one-line
errors on every rank, unknown keywords a TypeError.
"""

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.errors import UsageError
from tests.helpers import dataset, mlp, mse, same_tensors

DDP_STYLE = dict(device_ids=None, output_device=None, dim=0, gradient_as_bucket_view=False,
                 static_graph=True, init_sync=True)


def _train(make):
    x, y = dataset()
    model = make(mlp())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    r = gs.rank()
    for step in range(3):
        lo = (step * 3 + r) * 4
        model.backward(mse(model(x[lo:lo + 4]), y[lo:lo + 4]), num_items=4)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _job():
    pg = dist.new_group([0, 1])  # ranks 0 and 1 of 3: rank 2 sits out
    out = {}
    if gs.rank() < 2:
        out["ours"] = _train(lambda m: gs.DataParallel(m, group=pg))
        out["ddp_style"] = _train(lambda m: gs.DataParallel(m, process_group=pg, **DDP_STYLE))
    errors = {}
    for kw in ({"device_ids": [0]}, {"output_device": "cuda:0"}, {"dim": 1},
               {"init_sync": False}, {"process_group": pg, "group": dist.group.WORLD},
               {"bucket_size": 5}):
        case = "+".join(kw)
        try:
            gs.DataParallel(mlp(), **kw)
            errors[case] = None
        except (UsageError, TypeError) as e:
            errors[case] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    return out


def test_ddp_keywords_train_the_same_or_say_why_not():
    results = gs.spawn(_job, 3, timeout_s=120)
    assert [list(r) for r in results] == [["ours", "ddp_style", "errors"]] * 2 + [["errors"]]
    for r in (0, 1):
        a, b = results[r]["ours"], results[r]["ddp_style"]
        assert same_tensors(a, b), f"rank {r}"
    init = [p.detach() for p in mlp().parameters()]
    assert len(init) == len(results[0]["ours"])
    assert any(not torch.equal(p, q) for p, q in zip(results[0]["ours"], init))  # it trained
    expected = {"device_ids": "device_ids=[0] does not name the module's one device; "
                              "leave it None",
                "output_device": "output_device='cuda:0' does not name",
                "dim": "dim=1; only 0", "init_sync": "init_sync=False is not supported",
                "process_group+group": "pass group or process_group",
                "bucket_size": "TypeError: DataParallel got unexpected keyword argument(s) "
                               "['bucket_size']"}
    for res in results:
        assert list(res["errors"]) == list(expected)
        for case, words in expected.items():
            msg = res["errors"][case]
            assert msg is not None and words in msg and "\n" not in msg, (words, msg)


def _hooks_job():
    """torch's built-in comm hooks map to gradsync reductions; the no_sync flag by name."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from gradsync.engine.transport import comm

    x, y = dataset()
    out = {}
    for name, state, hook in (("allreduce", None, default_hooks.allreduce_hook),
                              ("fp16", None, default_hooks.fp16_compress_hook),
                              ("bf16", None, default_hooks.bf16_compress_hook),
                              ("powersgd", psgd.PowerSGDState(
                                  None, matrix_approximation_rank=2, start_powerSGD_iter=3),
                               psgd.powerSGD_hook)):
        model = gs.DataParallel(mlp())
        model.register_comm_hook(state, hook)
        red = model._reduction
        comp = getattr(red, "compressor", None)
        out[name] = (type(red).__name__, type(comp).__name__, getattr(comp, "name", None),
                     getattr(comp, "rank", None), getattr(red, "exact_windows", None))
        model.backward(mse(model(x[:8]), y[:8]), num_items=8)
        out[name + "_grad"] = next(model.parameters()).grad.clone()
    try:
        gs.DataParallel(mlp()).register_comm_hook(None, lambda state, bucket: None)
        out["custom"] = None
    except UsageError as e:
        out["custom"] = str(e)
    model = gs.DataParallel(mlp())
    events = []
    with comm.add_observer(lambda phase, e: events.append(e.tag)):
        model.require_backward_grad_sync = False
        model.backward(mse(model(x[:8]), y[:8]), num_items=8)
        out["flag"] = (model.require_backward_grad_sync, len(events))
        model.require_backward_grad_sync = True
        model.backward(mse(model(x[8:16]), y[8:16]), num_items=8)
        out["flag_after"] = len(events) > 0
    return out


def test_torch_comm_hooks_map_to_gradsync_reductions():
    res = gs.spawn(_hooks_job, 2, timeout_s=120)[0]
    assert res["allreduce"] == ("AllReduceBuckets", "NoneType", None, None, None)
    assert res["fp16"][:3] == ("CompressedBuckets", "HalfPrecisionCompressor", "fp16")
    assert res["bf16"][:3] == ("CompressedBuckets", "HalfPrecisionCompressor", "bf16")
    assert res["powersgd"] == ("CompressedBuckets", "PowerSGDCompressor", "powersgd", 2, 3)
    for name in ("fp16", "bf16", "powersgd"):  # the first window is exact
        assert torch.equal(res[name + "_grad"], res["allreduce_grad"])
    assert "not one of torch's built-in hooks" in res["custom"] and "\n" not in res["custom"]
    assert res["flag"] == (False, 0) and res["flag_after"] is True


class _PerRank(torch.nn.Module):
    """A shared trunk and, ignored by DDP, a per-rank head and a buffer whose shape
    differs across ranks (state kept in sync by other means, or not at all)."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(7)
        self.trunk = torch.nn.Linear(6, 4).double()
        torch.manual_seed(100 + rank)
        self.head = torch.nn.Linear(4, 3).double()
        self.register_buffer("seen", torch.zeros(rank + 1, dtype=torch.float64))

    def forward(self, x):
        self.seen += 1
        return self.head(torch.tanh(self.trunk(x)))


def _ignore_job():
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = dataset()
    r = gs.rank()
    out = {}
    for kind in ("torch", "gs"):
        module = _PerRank(r)
        DDP._set_params_and_buffers_to_ignore_for_model(
            module, ["head.weight", "head.bias", "seen"])
        model = DDP(module) if kind == "torch" else gs.DataParallel(module)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for step in range(3):
            lo = (step * 2 + r) * 4
            mse(model(x[lo:lo + 4]), y[lo:lo + 4]).backward()
            opt.step()
            opt.zero_grad()
        out[kind] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        module = _PerRank(r)
        module._ddp_params_and_buffers_to_ignore = ["seen"]
        gs.FullyShardedDataParallel(module)
        out["fsdp"] = None
    except UsageError as e:
        out["fsdp"] = str(e)
    return out


def test_parameters_and_buffers_ddp_ignores_are_left_alone_as_in_ddp():
    results = gs.spawn(_ignore_job, 2, timeout_s=120)
    for res in results:
        assert list(res["gs"]) == list(res["torch"]) and res["torch"]
        for name, value in res["torch"].items():
            torch.testing.assert_close(res["gs"][name], value, rtol=0, atol=1e-12, msg=name)
        assert "shards every parameter" in res["fsdp"]
    heads = [res["gs"]["head.weight"] for res in results]
    assert not torch.equal(heads[0], heads[1])  # per rank, never synchronised
    assert torch.equal(results[0]["gs"]["trunk.weight"], results[1]["gs"]["trunk.weight"])
