"""Audit what every rank's sampler really hands out in one epoch, on real processes.

The failure it catches: without a distributed sampler every rank draws from the
whole dataset, and the "global batch" is mostly duplicates. The audit gathers
the indices each rank consumed and reports overlaps and missing indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data import DistributedSampler, audit_indices
from ..data.audit import SamplerAudit

MODES = ("pad", "drop", "exact", "none")


@dataclass(frozen=True)
class SamplerCheck:
    dataset_len: int
    workers: int
    audits: dict[str, SamplerAudit]

    def verdict(self, mode: str) -> tuple[bool, str]:
        a = self.audits[mode]
        pad = (-self.dataset_len) % self.workers
        if mode == "exact":
            return a.is_partition, "every index exactly once"
        if mode == "pad":
            ok = not a.missing and a.n_duplicate_draws == pad
            return ok, f"nothing missing, {pad} padded repeat(s)"
        if mode == "drop":
            ok = not a.duplicated and len(a.missing) == self.dataset_len % self.workers
            return ok, f"no overlap, {self.dataset_len % self.workers} dropped"
        return True, "no distributed sampler: ranks overlap (the bug the sampler prevents)"

    @property
    def passed(self) -> bool:
        return all(self.verdict(m)[0] for m in self.audits)


def _audit_job(dataset_len: int, seed: int):
    import torch.distributed as dist

    out = {}
    for mode in MODES:
        if mode == "none":  # every rank shuffles the whole dataset on its own
            g = torch.Generator().manual_seed(seed + dist.get_rank())
            per_rank = (dataset_len + dist.get_world_size() - 1) // dist.get_world_size()
            consumed = torch.randperm(dataset_len, generator=g)[:per_rank].tolist()
        else:
            sampler = DistributedSampler(range(dataset_len), seed=seed, mode=mode)
            sampler.set_epoch(1)
            consumed = list(sampler)
        out[mode] = audit_indices(consumed, dataset_len)
    return out


def run_sampler_check(dataset_len: int, workers: int, seed: int = 0) -> SamplerCheck:
    from ..launch import spawn

    audits = spawn(_audit_job, workers, dataset_len, seed)[0]
    return SamplerCheck(dataset_len, workers, audits)
