"""Rich tables for the planner's dataclasses (the planners themselves never render)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..plan.batch import BatchPlan
from ..plan.comm import CommPlan
from ..plan.memory import MemoryPlan
from ..plan.simulate import StepResult, Sweep
from ..plan.two_level import ALGORITHMS, TwoLevelPlan
from ..plan.units import fmt_bytes, fmt_time


def print_table(table: Table) -> None:
    Console(soft_wrap=False, width=120).print(table)


NOT_ESTIMATED = "not estimated"
"""What a quantity the plan did not estimate shows: never '0 B', which reads as measured."""


def memory_table(plan: MemoryPlan, source: str = "", assumes: str = "") -> Table:
    """``assumes``: the precision and optimizer the plan is for, said in the title."""
    bpp = plan.per_param
    assumes = assumes or f"{plan.precision}, {plan.optimizer}"
    title = (
        f"Per-device memory, P = {plan.num_params:,} parameters{f' ({source})' if source else ''},"
        f" N = {plan.world_size}, {assumes}; bytes/param: params {bpp.params:g}, grads"
        f" {bpp.grads:g}, optimizer {bpp.optimizer:g} (GB = 1e9 B)"
    )
    t = Table(title=title)
    if plan.activations is None:
        t.caption = ("activations not estimated (give --seq-len, --hidden, --layers and "
                     "--heads): totals" + (" and the fits verdict" if plan.device_memory
                                           is not None else "") + " count model states only")
    notes = [t.caption] if t.caption else []
    if plan.checkpointing == "block":
        notes.append("activations with --activation-checkpointing: each block's input, and "
                     "one block's whole set while it is recomputed")
    if plan.loader is not None:
        notes.append(loader_line(plan.loader))
    t.caption = "\n".join(notes) or None
    for col in ("strategy", "params", "grads", "optimizer", "activations", "total"):
        t.add_column(col, justify="right" if col != "strategy" else "left")
    if plan.device_memory is not None:
        t.add_column(f"fits {fmt_bytes(plan.device_memory)}?", justify="center")
    for s in plan.stages:
        row = [s.stage, fmt_bytes(s.params), fmt_bytes(s.grads), fmt_bytes(s.optimizer),
               NOT_ESTIMATED if s.activations is None else fmt_bytes(s.activations),
               fmt_bytes(s.total)]
        if s.fits is not None:
            row.append("[green]fits[/]" if s.fits else "[red]does not fit[/]")
        t.add_row(*row)
    return t


def loader_line(loader) -> str:
    """The data loader's host memory, in words (outside the device totals)."""
    who = (f"{loader.workers} loader worker{'s' * (loader.workers != 1)} x "
           f"{loader.prefetch} ahead + 1 in use" if loader.workers else "no loader workers: 1")
    return (f"host memory for data loading (not on the device): {who} = {loader.batches} "
            f"micro-batch{'es' * (loader.batches != 1)} of {fmt_bytes(loader.batch_bytes)}, "
            f"{fmt_bytes(loader.host)}, and {fmt_bytes(loader.pinned)} more pinned on a GPU")


MICRO_STEPS = "micro-steps per worker per step"


def batch_table(plan: BatchPlan) -> Table:
    how = "rounded to a power of two" if plan.rounded else "not rounded"
    t = Table(
        title=(
            f"Global batch {plan.global_tokens:,.0f} tokens / seq {plan.seq_len} = "
            f"{plan.samples_exact:.1f} samples -> {plan.samples} ({how}); micro-batch "
            f"{plan.micro_batch}"
        )
    )
    # "micro-steps": what each worker runs per optimizer step (issue 37: the column said
    # "steps to run", read as optimizer steps, which the plan does not choose)
    for col in ("workers", "grad_acc", MICRO_STEPS, "samples/step", "note"):
        t.add_column(col, justify="right" if col != "note" else "left")
    t.caption = (f"{MICRO_STEPS}: micro-batches of {plan.micro_batch} each worker runs "
                 "(forward and backward) per optimizer step, grad_acc rounded up; "
                 "samples/step: what one optimizer step then takes over all workers")
    for r in plan.rows:
        if r.below_one:
            note = "[red]accumulation < 1: too many workers (shrink mbs or grow the batch)[/]"
        elif not r.exact:
            note = "[yellow]not a whole number of micro-steps[/]"
        else:
            note = ""
        t.add_row(str(r.workers), f"{r.grad_accum:g}", str(r.grad_accum_steps),
                  str(r.samples_per_step), note)
    return t


def comm_table(plan: CommPlan) -> Table:
    t = Table(
        title=(
            f"Gradient of {plan.num_params:,} x {plan.itemsize} B = {fmt_bytes(plan.grad_bytes)}; "
            f"link {plan.bandwidth / 1e9:g} GB/s (1e9 B/s), alpha {fmt_time(plan.alpha)}"
        )
    )
    cols = ["N", "ring AR", "tree AR", "RS", "AG"]
    if plan.per_node:
        cols.append(f"hier {plan.per_node}/node")
    cols += ["PS ingress", "DP,Z1,Z2 vol", "Z3 vol", "Z3 time"]
    for c in cols:
        t.add_column(c, justify="right")
    t.caption = "\n".join(["AR all-reduce, RS reduce-scatter, AG all-gather, PS parameter "
                           "server; vol = bytes each worker sends per step (DP/ZeRO-1/2: 2P, "
                           "ZeRO-3: 3P)", *plan.notes])  # notes: what was assumed or measured
    t.caption_justify = "left"
    for r in plan.rows:
        row = [str(r.workers), fmt_time(r.ring_s), fmt_time(r.tree_s),
               fmt_time(r.reduce_scatter_s), fmt_time(r.all_gather_s)]
        if plan.per_node:
            row.append("-" if r.hierarchical_s is None else fmt_time(r.hierarchical_s))
        row += [fmt_time(r.ps_ingress_s), fmt_bytes(r.dp_volume_bytes),
                fmt_bytes(r.zero3_volume_bytes), fmt_time(r.zero3_s)]
        t.add_row(*row)
    return t


def _link(link) -> str:
    rate = "unlimited" if link.beta_s_per_byte == 0 else f"{link.bandwidth * 8 / 1e6:,.0f} Mbit/s"
    return f"alpha {fmt_time(link.alpha_s)}, {rate}"


def two_level_table(plan: TwoLevelPlan) -> Table:
    t = Table(title=(f"All-reduce of a {fmt_bytes(plan.nbytes)} gradient on hosts of "
                     f"{plan.ranks_per_host} ranks: inside a host {_link(plan.intra)}, "
                     f"between hosts {_link(plan.inter)}"))
    for c in ("N", "hosts", *ALGORITHMS, "fastest", "busiest host link out"):
        t.add_column(c, justify="left" if c == "fastest" else "right")
    t.caption = ("plan.two_level: every round's messages priced on the link they cross; a "
                 "host's outgoing bytes share its link. Busiest host link: the fastest "
                 "algorithm's bytes out of one host per all-reduce")
    for r in plan.rows:
        best = r.fastest
        t.add_row(str(r.workers), str(r.hosts), *(fmt_time(c.seconds) for c in r.costs),
                  best.algorithm, fmt_bytes(best.max_host_out_bytes))
    return t


def simulate_table(result: StepResult, sweep: Sweep | None = None) -> Table:
    t = Table(title=f"Simulated step, bucket cap {result.bucket_cap_mb:g} MB "
                    f"({len(result.buckets)} buckets, {result.accum_steps} micro-step(s))")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    rows = [
        ("step time", fmt_time(result.step_s)),
        ("forward", fmt_time(result.forward_s)),
        ("backward", fmt_time(result.backward_s)),
        ("optimizer", fmt_time(result.optimizer_s)),
        ("communication (sum of buckets)", fmt_time(result.comm_s)),
        ("exposed communication", fmt_time(result.exposed_s)),
        ("scaling efficiency", f"{result.efficiency:.1%}"),
    ]
    if sweep is not None:
        gap = sweep.default_s / sweep.optimum_s - 1 if sweep.optimum_s > 0 else 0.0
        rows += [
            ("optimal bucket (sweep 1 MB..2 GB)", f"{sweep.optimum_mb:.3g} MB"),
            ("optimal step time", fmt_time(sweep.optimum_s)),
            (f"default ({sweep.default_mb:g} MB) step time", fmt_time(sweep.default_s)),
            ("default vs optimal", f"+{gap:.1%}"),
        ]
    for k, v in rows:
        t.add_row(k, v)
    return t
