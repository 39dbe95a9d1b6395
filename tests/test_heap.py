"""Workers keep freed heap memory: a stage-3 step stops re-faulting the model's pages.

Stage 3 frees and re-allocates every unit's gathered parameters and gradient each
step; with glibc's defaults those multi-MB blocks go back to the kernel and come
back as fresh zero-filled pages (thousands of page faults per step, about one per
4 KiB of model). ``gradsync.heap.keep_freed_memory`` is applied by the launcher.
"""

import pytest
import torch
from torch import nn

import gradsync as gs

WIDTH, DEPTH = 1024, 8  # 4 MiB per unit, as in benchmarks/zero_vs_torch.py


def _faults_per_step():
    import resource

    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    model = gs.FullyShardedDataParallel(module, wrap={nn.Linear})
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, WIDTH)
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model.backward(model(x).square().mean(), num_items=64)
        opt.step()
        opt.zero_grad()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(faults[2:])  # steady state


@pytest.mark.parametrize("setting", ["1", "0"])
def test_stage3_steady_state_page_faults(setting, monkeypatch):
    monkeypatch.setenv("GRADSYNC_KEEP_FREED_MEMORY", setting)
    faults = gs.spawn(_faults_per_step, 2)
    model_pages = DEPTH * WIDTH * (WIDTH + 1) * 4 // 4096
    if setting == "1":
        assert max(faults) < model_pages // 20, (faults, model_pages)
    else:  # glibc's defaults: the unit buffers come back as fresh pages
        assert min(faults) > model_pages // 4, (faults, model_pages)
