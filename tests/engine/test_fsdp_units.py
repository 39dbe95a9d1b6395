"""Stage-3 units: their order, one dtype each, and a rank with no data replaying the
gathers of forwards that are not in registration order (float64, against one process)."""

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.engine.sharded.fsdp.units import build_units

D = 6
LR = 0.1


class Block(nn.Module):
    def __init__(self, extra=False):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.extra = nn.Linear(D, D) if extra else None  # a unit of another size

    def forward(self, x):
        x = torch.tanh(self.lin(x)) + x
        return self.extra(x) if self.extra is not None else x


class Nested(nn.Module):
    """Units at two depths: a ModuleList registered (and used) first, then root children."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Block(), Block()])
        self.f1 = Block()
        self.f2 = Block(extra=True)
        self.double()

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return self.f2(self.f1(x))


class OutOfOrder(nn.Module):
    """Forward order is not registration order, one unit runs twice, the root has a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.late = Block(extra=True)  # registered first, used last
        self.early = Block()
        self.twice = Block()
        self.head = nn.Linear(D, D)
        self.double()

    def forward(self, x):
        x = self.twice(self.twice(self.early(x)))
        return self.head(self.late(x))


MODELS = {"nested": Nested, "out_of_order": OutOfOrder}
# step -> ranks with data (the others call backward(None, num_items=0) without a forward)
SCHEDULE = [(0, 1), (1,), (0,), (0, 1), (1,)]


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    n = 3 + rank
    return (torch.randn(n, D, generator=g, dtype=torch.float64),
            torch.randn(n, D, generator=g, dtype=torch.float64))


def mse_sum(out, y):
    return ((out - y) ** 2).sum()


def reference(name):
    model = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step, ranks in enumerate(SCHEDULE):
        xs, ys = zip(*(batch(step, r) for r in ranks))
        x, y = torch.cat(xs), torch.cat(ys)
        (mse_sum(model(x), y) / len(x)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def worker(name, prefetch):
    torch.set_num_threads(1)
    model = gs.FullyShardedDataParallel(MODELS[name](), wrap={Block}, prefetch=prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step, ranks in enumerate(SCHEDULE):
        if gs.rank() in ranks:
            x, y = batch(step, gs.rank())
            model.backward(mse_sum(model(x), y) / len(x), num_items=len(x))
        else:
            model.backward(None, num_items=0)
        opt.step()
        opt.zero_grad()
    return model.full_state_dict()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_rank_without_data_replays_the_gathers_of_the_forward_it_did_not_run(name):
    ref = reference(name)
    for prefetch in (1, 2):
        for state in gs.spawn(worker, 2, name, prefetch, timeout_s=120):
            gap = max(float((state[k] - ref[k]).abs().max()) for k in ref)
            assert gap < 1e-12, (name, prefetch, gap)


def test_units_come_in_module_pre_order():
    """The order a rank without any recorded forward replays (and prefetch follows)."""
    model = Nested()
    names = {id(m): n for n, m in model.named_modules()}
    units = build_units(model, {Block}, world=1, rank=0, param_dtype=None)
    assert [names[id(u.module)] for u in units] == ["layers.0", "layers.1", "f1", "f2"]


def test_a_unit_mixing_dtypes_is_refused_and_the_model_left_whole():
    model = Nested()
    model.f1.lin.float()  # a unit all float32: fine
    model.f2.extra.float()  # a unit mixing float64 (lin) and float32 (extra): refused
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(gs.UsageError, match=r"unit f2 \(Block\) mixes parameter dtypes: "
                                            r"f2\.lin\.weight \(float64\).*"
                                            r"f2\.extra\.weight \(float32\)"):
        build_units(model, {Block}, world=1, rank=0, param_dtype=None)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())
    assert len(list(model.parameters())) == 10


class TiedByHand(nn.Module):
    """An output projection written as ``h @ embed.weight.T`` in the parent's forward,
    not as a shared module attribute: the parameter is used outside its module."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Linear(D, 4, bias=False)
        self.body = Block()
        self.double()

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        return self.body(h @ self.embed.weight)


def tied_by_hand(wrap):
    """The embedding a unit of its own: a clear error on every rank (before this, the
    placeholder was a meta tensor and ``cpu @ meta`` returned uninitialised memory);
    the embedding in the root unit: trained exactly, as one process."""
    torch.set_num_threads(1)
    model = gs.FullyShardedDataParallel(TiedByHand(), wrap=wrap)
    weight = model.module.embed.weight
    meta = (tuple(weight.shape), weight.dtype, weight.requires_grad, weight.numel())
    x, y = batch(0, gs.rank())
    try:
        model.backward(mse_sum(model(x), y) / len(x), num_items=len(x))
    except gs.UsageError as e:
        return {"meta": meta, "error": str(e), "state": None}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    return {"meta": meta, "error": None, "state": model.full_state_dict()}


@pytest.mark.timeout(120)
def test_a_unit_parameter_used_outside_its_unit_is_refused_not_garbage():
    for res in gs.spawn(tied_by_hand, 2, {nn.Linear, Block}, timeout_s=60):
        assert res["meta"] == ((4, D), torch.float64, False, 4 * D)  # metadata still answers
        error = res["error"]
        assert isinstance(error, str), "computed with a sharded parameter"
        assert "'embed.weight'" in error and "unit 'embed'" in error and "matmul" in error
    model = TiedByHand()
    x, y = map(torch.cat, zip(batch(0, 0), batch(0, 1)))
    (mse_sum(model(x), y) / len(x)).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    for res in gs.spawn(tied_by_hand, 2, {Block}, timeout_s=60):
        state = res["state"]
        assert res["error"] is None and list(state) == list(model.state_dict())
        assert max(float((state[k] - v).abs().max()) for k, v in model.state_dict().items()) < 1e-12
