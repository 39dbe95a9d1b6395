"""Audit which dataset indices each rank consumed in an epoch.

The exactness of data parallelism rests on the shards partitioning the data;
the classic failure (every worker shuffling the full dataset on its own) is
silent and only shows as worse accuracy. Gathering the indices every rank
actually consumed and counting overlaps and gaps turns that assumption into
something checked. Computing (``summarize_shards``) is kept apart from
communicating (``audit_indices``) and from rendering (``render_audit``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from rich.table import Table

from ..engine.transport import comm


@dataclass
class SamplerAudit:
    """What K ranks consumed from a dataset of ``dataset_len`` items.

    ``duplicated`` maps an index consumed more than once to the ranks that
    consumed it, one entry per draw (so a rank drawing it twice appears twice).
    """

    dataset_len: int
    world_size: int
    per_rank_counts: list[int]
    duplicated: dict[int, list[int]] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    total_consumed: int = 0

    @property
    def is_partition(self) -> bool:
        """Every index consumed exactly once across all ranks."""
        return not self.duplicated and not self.missing

    @property
    def n_duplicate_draws(self) -> int:
        """Draws beyond the first of each index (pad mode: the padded count)."""
        return sum(len(ranks) - 1 for ranks in self.duplicated.values())


def summarize_shards(per_rank_indices: list[list[int]], dataset_len: int) -> SamplerAudit:
    """Pure: count per-rank draws, repeated indices and never-drawn indices.

    Indices outside ``[0, dataset_len)`` are a bug in the caller's sampler;
    they raise rather than being silently counted.
    """
    drawn_by: dict[int, list[int]] = defaultdict(list)
    for rank, indices in enumerate(per_rank_indices):
        for i in indices:
            i = int(i)
            if not 0 <= i < dataset_len:
                raise ValueError(f"rank {rank} consumed index {i}, outside [0, {dataset_len})")
            drawn_by[i].append(rank)
    counts = [len(ix) for ix in per_rank_indices]
    return SamplerAudit(
        dataset_len=dataset_len,
        world_size=len(per_rank_indices),
        per_rank_counts=counts,
        duplicated={i: r for i, r in sorted(drawn_by.items()) if len(r) > 1},
        missing=[i for i in range(dataset_len) if i not in drawn_by],
        total_consumed=sum(counts),
    )


def audit_indices(consumed: Iterable[int], dataset_len: int, group=None) -> SamplerAudit:
    """Collective: gather every rank's consumed indices; all ranks get the same audit."""
    mine = [int(i) for i in consumed]
    gathered = comm.all_gather_object(mine, group=group, tag="sampler_audit")
    return summarize_shards(gathered, dataset_len)


def audit_sampler(sampler, epoch: int, group=None) -> SamplerAudit:
    """Collective: iterate one epoch of ``sampler`` on each rank and audit it.

    ``sampler`` needs ``set_epoch`` and ``dataset_len`` (gradsync's
    DistributedSampler) or a ``data_source``/``dataset`` with ``len()``.
    """
    sampler.set_epoch(epoch)
    n = getattr(sampler, "dataset_len", None)
    if n is None:
        source = getattr(sampler, "dataset", None)
        n = len(source if source is not None else sampler.data_source)
    return audit_indices(list(iter(sampler)), n, group=group)


def render_audit(audit: SamplerAudit, title: str = "sampler audit") -> Table:
    """A rich table: per-rank counts, then the verdict with a few examples."""
    table = Table(title=title)
    table.add_column("rank", justify="right")
    table.add_column("indices consumed", justify="right")
    for rank, c in enumerate(audit.per_rank_counts):
        table.add_row(str(rank), str(c))
    table.add_section()
    table.add_row("total", f"{audit.total_consumed} of {audit.dataset_len}")
    dups = [f"{i} by ranks {r}" for i, r in audit.duplicated.items()]
    table.add_row("duplicate draws", f"{audit.n_duplicate_draws}{_examples(dups, 3)}")
    table.add_row("missing", f"{len(audit.missing)}{_examples(audit.missing, 8)}")
    verdict = "[green]partition[/]" if audit.is_partition else "[red]not a partition[/]"
    table.add_row("verdict", verdict)
    return table


def _examples(items: list, k: int) -> str:
    """`` (a, b, ...)``: the first ``k`` items, with an ellipsis when cut short."""
    if not items:
        return ""
    more = ", ..." if len(items) > k else ""
    return f" ({', '.join(map(str, items[:k]))}{more})"
