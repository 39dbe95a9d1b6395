"""Run by torchrun on every emulated host: a hierarchical all-reduce, checked exactly.

Each rank contributes integer-valued float64 data from its rank; the result must
equal the exact sum on every rank (bitwise), and every rank prints its host
layout and a digest of the result so the test can compare ranks across hosts.
"""

import hashlib
import os
import sys

import torch

import gradsync as gs
from gradsync.engine.transport.algorithms import HostTopology, hierarchical, ring


def contribution(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-1000, 1000, (numel,), generator=g).double()


def main() -> None:
    torch.set_num_threads(1)
    info = gs.init()
    top = HostTopology.from_env()
    numel = 100_003  # 800 KB, does not divide by the world size
    expected = sum(contribution(r, numel) for r in range(info.world_size))
    t = contribution(info.rank, numel)
    hierarchical.all_reduce_(t, top)
    assert torch.equal(t, expected), "hierarchical all-reduce is not the exact sum"
    flat = contribution(info.rank, numel)
    ring.all_reduce_(flat)
    assert torch.equal(flat, expected), "ring all-reduce is not the exact sum"
    digest = hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
    line = (f"rank={info.rank} host={top.host} local={top.local_rank} hosts={top.num_hosts} "
            f"group_rank={os.environ['GROUP_RANK']} digest={digest}\n")
    # One write(2) per line: two workers share the agent's stdout pipe, and print()
    # under PYTHONUNBUFFERED=1 writes the text and its newline separately, so lines
    # from the two could interleave. A single write below PIPE_BUF is atomic.
    os.write(sys.stdout.fileno(), line.encode())
    top.close()
    gs.shutdown()


if __name__ == "__main__":
    main()
