"""The core multi-rank tests again, under NCCL's rules (``GRADSYNC_NCCL_RULES=1``).

The same files, the same assertions, on the strict process group of
``gradsync/nccl_rules.py`` instead of plain gloo: exact data parallelism, ZeRO 1-3,
the compressed reductions (bf16, fp16, int8, PowerSGD), the reference and two-level
algorithms, DiLoCo, and sharded save and resume. Under the rules a sharded strategy
takes NCCL's choice of collectives (``reduce_scatter``/``all_gather``, where gloo
takes point-to-point exchanges), so this also runs those paths for real. Before the
point-to-point rounds were grouped, 29 of these tests failed here.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CORE = ["tests/engine/test_dp_exactness.py", "tests/engine/test_zero.py",
        "tests/engine/test_fsdp.py", "tests/engine/test_compress.py",
        "tests/engine/test_compress_steps.py", "tests/engine/test_hierarchical.py",
        "tests/engine/test_algorithms.py", "tests/engine/test_diloco.py",
        "tests/engine/test_zero_checkpoint.py"]


def test_the_core_multi_rank_tests_pass_under_nccl_rules():
    env = dict(os.environ, GRADSYNC_NCCL_RULES="1")
    res = subprocess.run([sys.executable, "-m", "pytest", *CORE, "-q", "-n", "0", "-p",
                          "no:cacheprovider"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    tail = "\n".join(res.stdout.splitlines()[-30:])
    assert res.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail
