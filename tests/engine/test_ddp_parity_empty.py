"""The same model as torch DDP, rule 5: a rank with no data joins the step whether it ran
the forward (NaN loss, ``num_items=0``) or skipped it (``backward(None, num_items=0)``),
in a step and in a no_sync micro-step; compared with one process on each step's whole
batch. Rules 1 to 4 and how the comparison works: ``test_ddp_parity.py``.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.engine.sharded_models import Block, Net
from tests.helpers import dataset, mse
from tests.parity_helpers import Trainer, failures
from tests.parity_plan import Spawned, jobs, sgd

# step -> rank -> items of each micro-step (every rank runs as many micro-steps)
EMPTY_SCHEDULE = [[[5], [3]], [[7], [0]], [[2, 4], [0, 3]], [[0, 0], [4, 2]]]


def empty_rank(ctx, group, form="forward"):
    """Rule 5: a rank with no data, in a step and in a no_sync micro-step.

    ``form="forward"``: the empty rank still runs the forward on its 0-row batch and
    passes the NaN mean with ``num_items=0`` (what ``DataParallel.backward``'s
    docstring promises); ``"skip"``: it calls ``backward(None, num_items=0)``.
    Compared with one process on each step's whole batch.
    """
    t = Trainer(ctx, Net(hidden=8, seed=8), group, sgd(), wrap={Block})
    x, y = dataset(n=96)
    rec, cursor = {}, 0
    for s, step in enumerate(EMPTY_SCHEDULE):
        micros = len(step[0])
        owned = {}
        for k in range(micros):
            for r in range(ctx.world):
                owned[(k, r)] = list(range(cursor, cursor + step[r][k]))
                cursor += step[r][k]
        if ctx.local:
            idx = [i for k in range(micros) for r in range(ctx.world) for i in owned[(k, r)]]
            mse(t(x[idx]), y[idx]).backward()
        else:
            for k in range(micros):
                idx = owned[(k, ctx.rank)]
                with t.no_sync() if k < micros - 1 else contextlib.nullcontext():
                    if idx or form == "forward":
                        t.model.backward(mse(t(x[idx]), y[idx]), num_items=len(idx))
                    else:
                        t.model.backward(None, num_items=0)
        t.step_and_record(rec, s)
    return rec


def test_rule5_rank_without_data_skipping_the_forward():
    res = SPAWN.results()
    lines = failures(res, "empty/skip", ["gs_items", "zero2_items", "fsdp_items"],
                     against="local")
    assert not lines, "\n".join(lines)


def test_rule5_rank_without_data_running_the_forward():
    res = SPAWN.results()
    lines = failures(res, "empty/forward", ["gs_items", "zero2_items"], against="local")
    assert not lines, "\n".join(lines)


def test_rule5_fsdp_rank_without_data_running_the_forward():
    """Last in its spawn: a mismatched collective sequence makes gloo abort the process."""
    SPAWN.check("empty/forward", ["fsdp_items"], against="local")


# ----------------------------------------------------------------------------- the spawn
def _plan():
    return (
        jobs("empty/skip", empty_rank, ("local", "gs_items", "zero2_items", "fsdp_items"),
             form="skip")
        # last: a mismatched collective sequence makes gloo abort the process
        + jobs("empty/forward", empty_rank, ("local", "gs_items", "zero2_items", "fsdp_items"),
               form="forward")
    )


SPAWN = Spawned(_plan)


@pytest.fixture(autouse=True, scope="module")
def _drop_results():
    yield
    SPAWN.clear()
