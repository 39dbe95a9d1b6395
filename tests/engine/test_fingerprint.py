"""Desync is named where it happens: the window fingerprint riding in the item header.

Real 2-process gloo runs. Mismatched ``no_sync``, a different number of synchronised
backwards per step (one rank issues a sync's collectives the other does not) and
collectives that differ across ranks are a DesyncError on every rank, with the same
message naming the ranks, the step and what differs; uneven micro-steps (supported:
``num_items`` makes them exact) and ``GRADSYNC_DESYNC_CHECK=0`` raise nothing.
"""

import contextlib
import os

import torch
from torch import nn

import gradsync as gs
from gradsync.engine.transport import comm
from gradsync.engine.transport.fingerprint import DesyncError
from tests.helpers import SharedSpawn, job_table


def _train(case: str, steps: int = 3):
    torch.manual_seed(0)
    model = gs.DataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = gs.rank()
    x = torch.randn(8, 4, dtype=torch.float64)
    for step in range(steps):
        micro = 3 if case == "uneven" and r == 1 else 2
        for ms in range(micro):
            last = ms == micro - 1
            sync = {"nosync": last if r == 0 else ms == 0,  # rank 1 syncs at micro-step 1
                    "twice": last or r == 1}.get(case, last)  # rank 1 syncs every micro-step
            with contextlib.nullcontext() if sync else model.no_sync():
                model.backward(model(x[ms:]).pow(2).mean(), num_items=8 - ms)
        if case == "dtype" and step == 0:  # same bytes, different collective: gloo pairs them
            stat = torch.ones(2, dtype=torch.float64 if r == 0 else torch.int64)
            comm.all_reduce(stat, tag="loss")
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _outcome(case: str, env: str = "1"):
    previous = os.environ.get("GRADSYNC_DESYNC_CHECK")
    os.environ["GRADSYNC_DESYNC_CHECK"] = env
    try:
        _train(case)
        return {"error": None}
    except DesyncError as e:
        return {"error": str(e), "is_mismatch": isinstance(e, gs.ReplicaMismatchError)}
    finally:
        if previous is None:
            os.environ.pop("GRADSYNC_DESYNC_CHECK")
        else:
            os.environ["GRADSYNC_DESYNC_CHECK"] = previous


SPAWN = SharedSpawn(job_table(
    ("nosync", _outcome, ("nosync",)),
    ("twice", _outcome, ("twice",)),
    ("dtype", _outcome, ("dtype",)),
    ("uneven", _outcome, ("uneven",)),
    ("off", _outcome, ("nosync", "0")),
), timeout_s=60)


def _same_error_everywhere(name: str) -> str:
    results = SPAWN.results(name, 2)
    msgs = [res["error"] for res in results]
    assert msgs[0] is not None and msgs == [msgs[0]] * 2, msgs
    assert all(res["is_mismatch"] is True for res in results)
    return msgs[0]


def test_mismatched_no_sync_is_named_on_every_rank():
    msg = _same_error_everywhere("nosync")
    assert msg.startswith("ranks disagree at step 2 "), msg
    assert "rank 1 stepped differently" in msg
    assert "rank 1 took 1 optimizer step(s)" in msg and "under no_sync" in msg


def test_a_different_number_of_syncs_per_step_is_named():
    msg = _same_error_everywhere("twice")
    assert msg.startswith("ranks disagree at step 2 "), msg
    assert "rank 0 took 1 optimizer step(s)" in msg and "rank 1 took 0 optimizer step(s)" in msg
    assert "micro-steps in this window: 2 (rank 0), 1 (rank 1)" in msg


def test_a_collective_that_differs_is_named_with_the_first_difference():
    msg = _same_error_everywhere("dtype")
    assert msg.startswith("ranks disagree at step 2 "), msg
    assert "first differing collective: rank 0 issued all_reduce" in msg
    assert "'loss' (float64 x 2)" in msg and "rank 1 issued all_reduce" in msg
    assert "'loss' (int64 x 2)" in msg


def test_uneven_micro_steps_are_not_a_desync():
    assert [res["error"] for res in SPAWN.results("uneven", 2)] == [None, None]


def test_the_check_can_be_turned_off():
    assert [res["error"] for res in SPAWN.results("off", 2)] == [None, None]


def _device_thread(case: str, steps: int = 3):
    """On a GPU, autograd runs backward -- and gradsync's gradient hooks, which launch
    the buckets' collectives -- on its device thread, while a rank without data replays
    them on the main thread (``backward(None, num_items=0)``) and ``join()`` shadows
    them there. Emulated here: a rank's backward on a thread of its own."""
    import threading

    torch.manual_seed(0)
    model = gs.DataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double(),
                            bucket_cap_mb=0.0001)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    r = gs.rank()
    x = torch.randn(8, 4, dtype=torch.float64)
    for step in range(steps):
        idle = case == "idle" and r == 1 and step == 1
        out = None if idle else model(x).pow(2).mean()

        def backward(out=out, idle=idle):
            model.backward(out, num_items=0 if idle else 8)

        if r == 0:  # the "device thread"
            worker = threading.Thread(target=backward)
            worker.start()
            worker.join(timeout=60)
        else:
            backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_hooks_on_another_thread_are_not_a_desync():
    """Fingerprints were kept per (group, thread): the rank whose hooks ran on another
    thread had a different count of collectives than its peer, a false DesyncError.
    NCCL needs one issuing order per group, whichever thread issues; so is it kept."""
    for case in ("busy", "idle"):
        res = gs.spawn(_device_thread, 2, case, timeout_s=60)
        for a, b in zip(res[0], res[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
