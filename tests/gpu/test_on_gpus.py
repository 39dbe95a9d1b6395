"""The GPU smoke run's checks as tests, on the GPUs of this machine (``-m gpu``).

Skipped, with the reason, where torch sees no CUDA GPU (this project's CI). On a
GPU machine: ``python -m pytest tests/gpu -m gpu -n 0`` (docs/gpu.md says how to
install there). The same checks run on the CPU in ``tests/test_gpu_smoke_dry_run.py``.
"""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA GPU visible to torch")]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_every_mode_resumes_bitwise_and_matches_one_process_on_the_gpus(tmp_path):
    import gpu_smoke

    assert gpu_smoke.main(["--skip", "timing", "--json", str(tmp_path / "smoke.json")]) == 0
