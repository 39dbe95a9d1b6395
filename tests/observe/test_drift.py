"""The drift check: silent on healthy replicas, loud and precise on a perturbed one.

Two gloo workers; rank 1 nudges one element of one parameter by one ulp-scale
amount after a healthy check. Both ranks must raise, naming the parameter and
rank 1 -- a raise on one rank only would leave the other waiting in the next
collective. The checksums are bit-exact, so a perturbation that keeps the sum
(two elements swapped) is caught too.
"""

import torch

import gradsync as gs
from gradsync.engine.sync.drift import check_replicas, parameter_checksums
from gradsync.errors import ReplicaMismatchError
from tests.helpers import mlp


def _worker():
    dp = gs.DataParallel(mlp(seed=0))
    healthy = check_replicas(dp.module, step=1)
    if gs.rank() == 1:
        with torch.no_grad():
            dp.module[2].weight[3, 4] += 1e-12
    try:
        check_replicas(dp.module, step=7)
    except ReplicaMismatchError as e:
        return {"checked_when_healthy": healthy, "error": str(e)}
    return {"checked_when_healthy": healthy, "error": None}


def test_drift_check_silent_when_healthy_and_names_parameter_and_rank():
    results = gs.spawn(_worker, 2)
    n_params = len(list(mlp().parameters()))
    for res in results:
        assert res["checked_when_healthy"] == n_params
        err = res["error"]
        assert err is not None
        assert "'2.weight'" in err and "rank(s) 1" in err and "step 7" in err
    assert results[0]["error"] == results[1]["error"]  # the same message on every rank


def test_checksums_catch_a_sum_preserving_swap():
    model = mlp(seed=0)
    _, before = parameter_checksums(model)
    with torch.no_grad():
        w = model[0].weight
        a, b = w[0, 0].item(), w[0, 1].item()
        w[0, 0], w[0, 1] = b, a
    _, after = parameter_checksums(model)
    assert torch.equal(before[:, 1], after[:, 1])  # the plain bit sum cannot see a swap
    assert not torch.equal(before[:, 2], after[:, 2])  # the position-weighted one does
