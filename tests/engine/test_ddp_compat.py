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
from tests.helpers import dataset, mlp, mse

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
    errors = []
    for kw in ({"device_ids": [0]}, {"output_device": "cuda:0"}, {"dim": 1},
               {"init_sync": False}, {"process_group": pg, "group": dist.group.WORLD},
               {"bucket_size": 5}):
        try:
            gs.DataParallel(mlp(), **kw)
            errors.append(None)
        except (UsageError, TypeError) as e:
            errors.append(f"{type(e).__name__}: {e}")
    out["errors"] = errors
    return out


def test_ddp_keywords_train_the_same_or_say_why_not():
    results = gs.spawn(_job, 3, timeout_s=120)
    for r in (0, 1):
        a, b = results[r]["ours"], results[r]["ddp_style"]
        assert all(torch.equal(p, q) for p, q in zip(a, b))
    init = [p.detach() for p in mlp().parameters()]
    assert any(not torch.equal(p, q) for p, q in zip(results[0]["ours"], init))  # it trained
    expected = ["device_ids=[0] does not name the module's one device; leave it None",
                "output_device='cuda:0' does not name",
                "dim=1; only 0", "init_sync=False is not supported",
                "pass group or process_group", "TypeError: DataParallel got unexpected "
                "keyword argument(s) ['bucket_size']"]
    for res in results:
        for msg, words in zip(res["errors"], expected):
            assert msg is not None and words in msg and "\n" not in msg, (words, msg)
