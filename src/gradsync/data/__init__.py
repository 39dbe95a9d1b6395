"""Data feeding: the distributed sampler, its audit, and built-in offline datasets."""

from __future__ import annotations

from .audit import SamplerAudit, audit_indices, audit_sampler, render_audit, summarize_shards
from .corpus import TokenWindows, random_tokens, stdlib_bytes, stdlib_tokens
from .regression import RegressionDataset, make_regression
from .sampler import DistributedSampler

__all__ = [
    "DistributedSampler",
    "RegressionDataset",
    "SamplerAudit",
    "TokenWindows",
    "audit_indices",
    "audit_sampler",
    "make_regression",
    "random_tokens",
    "render_audit",
    "stdlib_bytes",
    "stdlib_tokens",
    "summarize_shards",
]
