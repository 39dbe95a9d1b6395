"""The same code under torch's own launcher: torchrun, one node and two emulated nodes."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from gradsync.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TRAIN = ["-m", "gradsync.train", "--steps", "4", "--seq-len", "32", "--global-batch", "4",
         "--micro-batch", "2", "--checkpoint-every", "0"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_minimal_example_runs_under_torchrun():
    r = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2",
                        str(ROOT / "examples" / "minimal.py")],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "epoch 4: loss" in r.stdout


def test_train_module_under_torchrun_single_node(tmp_path):
    r = subprocess.run([*TORCHRUN, "--nproc-per-node", "2", "--standalone", *TRAIN,
                        "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 4 and ckpt["world_size"] == 2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_train_module_two_nodes_rendezvous(tmp_path):
    """Two torchrun agents (one per 'node') meet through the c10d rendezvous."""
    port = _free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gradsync-test"]
    procs = [subprocess.Popen([*TORCHRUN, *common, *TRAIN, "--out", str(tmp_path / "run")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env())
             for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["world_size"] == 2 and ckpt["config"]["workers"] == 2


def _losses(run_dir: Path) -> list[float]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["loss"] for line in lines if '"loss"' in line]


def test_diloco_with_a_worker_per_node_at_h1_is_exact_sgd(tmp_path):
    """Two torchrun agents of 2 ranks each: ``--sync diloco --collectives hierarchical``
    makes each node one DiLoCo worker (exact inside it). With H = 1, an outer SGD of lr 1
    and inner SGD with momentum (linear in the gradient; no clipping, which is not),
    that is exact synchronous SGD on the global batch: the same losses as
    ``--sync exact``, step by step, to float32 rounding."""
    port = _free_port()
    sgd = ["--optimizer", "sgd", "--clip", "0", "--global-batch", "8", "--micro-batch", "2",
           "--eval-every", "0"]
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "gradsync-diloco-hosts"]
    local = ["--sync", "diloco", "--sync-every", "1", "--outer-lr", "1", "--outer-momentum",
             "0", "--collectives", "hierarchical"]
    procs = [subprocess.Popen([*TORCHRUN, *common, *TRAIN, *sgd, *local,
                               "--out", str(tmp_path / "hosts")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env())
             for _ in range(2)]
    try:
        # the --sync exact reference, by gradsync's own launcher in this process, while
        # the agents' fresh interpreters import torch (a CLI process after them: ~8 s more)
        code = cli_main(["train", *TRAIN[2:], "--workers", "2", *sgd, "--no-report",
                         "--out", str(tmp_path / "exact")])
    finally:
        outs = [p.communicate(timeout=240) for p in procs]
    assert code == 0
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    hosts, exact = _losses(tmp_path / "hosts"), _losses(tmp_path / "exact")
    assert len(hosts) == len(exact) == 4
    assert hosts[-1] < hosts[0]
    for a, b in zip(hosts, exact):
        assert abs(a - b) <= 1e-5 * abs(b), (hosts, exact)
