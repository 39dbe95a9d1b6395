"""Which bucket each gradient lives in, and the two ways that layout changes during a run.

DataParallel's buckets are planned by the pure ``plan.plan_buckets`` (shared
with the planner's simulator) and then change at most in two ways:

* **Rebuild once** after the first synchronised backward, in the order gradients
  actually became ready (DDP paper, arXiv 2006.15704, section 3.2.3). Rank 0's
  observed order is broadcast, because every rank must launch identical
  collectives in identical order.
* **Autotune** (``bucket_cap_mb="auto"``): candidate caps are measured during the
  first synchronised steps and the one that suits the slowest rank is kept.

The layout also reserves the small integer slots that may ride at the end of the
buffers when the reduction sums them exactly: the item-window header at the end
of the first bucket, the used mask (``find_unused_parameters``) at the end of the
last one, whose launch is the moment every parameter's use is known.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...errors import UsageError
from ..sync.item_window import WINDOW_SLOTS as HEADER_SLOTS  # items + desync fingerprint
from ..sync.replicas import ignored_names, without_ddp_prefix
from ..transport import comm, host
from .autotune import AutotuneResult, BucketAutotuner
from .buffer import Bucket
from .plan import BucketSpec, ParamSpec, mb_to_bytes, plan_buckets

_EXACT_SUM = ("float32", "float64")


def trainable_parameters(module: torch.nn.Module):
    """(parameters, names, specs) of the trainable parameters, tied weights once and
    named by every place they live (``"enc.weight = dec.weight"``)."""
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    ignore = ignored_names(module)
    params = [p for p in module.parameters()
              if p.requires_grad and not ignore.intersection(aliases[id(p)])]
    names = [" = ".join(aliases[id(p)]) for p in params]
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise UsageError(f"DataParallel expects a module on one device, found "
                         f"{sorted(map(str, devices))}")
    specs = [ParamSpec(n, p.numel(), p.element_size(), str(p.dtype).replace("torch.", ""))
             for n, p in zip(names, params)]
    return params, names, specs


class BucketLayout:
    """The buckets in use and where every trainable parameter's gradient lives."""

    def __init__(self, params: list[torch.nn.Parameter], specs: list[ParamSpec],
                 cap_bytes: int, first_bytes: int, group, device: torch.device,
                 autotuner: BucketAutotuner | None = None):
        self.params, self.specs = params, specs
        self.cap_bytes, self.first_bytes = cap_bytes, first_bytes
        self.group, self.device = group, device
        self.autotuner = autotuner
        self.rebuilt = False
        self.ready_order: list[int] | None = None
        self.buckets: list[Bucket] = []
        self._where: list[tuple[Bucket, int]] = []
        self.header_in_bucket = self.mask_in_bucket = False
        self.next_launch = 0  # buckets launch strictly in index order

    def plan(self, order: list[int] | None = None) -> list[BucketSpec]:
        return plan_buckets(self.specs, self.cap_bytes, self.first_bytes, order=order)

    def install(self, specs: list[BucketSpec], reduction, mask_slots: int) -> None:
        """Allocate buffers for ``specs`` (sized by ``reduction``) and point gradients at them.

        ``mask_slots`` > 0 asks for the used mask to ride in the last bucket.
        """
        sizes = [reduction.buffer_numel(s) for s in specs]
        self.header_in_bucket = bool(reduction.piggyback and specs
                                     and specs[0].dtype in _EXACT_SUM)
        self.mask_in_bucket = bool(reduction.piggyback and specs and mask_slots
                                   and specs[-1].dtype in _EXACT_SUM)
        if self.header_in_bucket:
            sizes[0] = specs[0].numel + HEADER_SLOTS
        if self.mask_in_bucket:
            sizes[-1] = max(sizes[-1], specs[-1].numel + (HEADER_SLOTS if len(specs) == 1
                                                         and self.header_in_bucket else 0))
            sizes[-1] += mask_slots
        self.buckets = [Bucket(s, [self.params[i] for i in s.params], n)
                        for s, n in zip(specs, sizes)]
        self._where = [None] * len(self.params)  # type: ignore[list-item]
        for b in self.buckets:
            for slot, i in enumerate(b.spec.params):
                self._where[i] = (b, slot)
            b.attach(keep_values=True)

    def where(self, i: int) -> tuple[Bucket, int]:
        return self._where[i]

    def launch_ready(self, reduction, window, used: list[bool]) -> None:
        """Launch, in index order, every bucket whose gradients are all in.

        The header is written into the first bucket as it launches; the used mask into
        the last, whose launch means every parameter's use in this window is known.
        """
        buckets = self.buckets
        while self.next_launch < len(buckets) and buckets[self.next_launch].pending == 0:
            b = buckets[self.next_launch]
            if self.next_launch == 0 and self.header_in_bucket:
                window.write(self.header_slots(), self.group)
            if self.next_launch == len(buckets) - 1 and self.mask_in_bucket:
                mask = self.mask_slots(len(used))
                mask.copy_(torch.tensor(used, dtype=mask.dtype))
            b.handle = reduction.launch(b)
            b.launched = True
            self.next_launch += 1

    def header_slots(self) -> torch.Tensor:
        first = self.buckets[0]
        return first.buffer[first.spec.numel:first.spec.numel + HEADER_SLOTS]

    def mask_slots(self, n: int) -> torch.Tensor:
        return self.buckets[-1].buffer[-n:]

    @property
    def plan_in_use(self) -> list[BucketSpec]:
        return [b.spec for b in self.buckets]

    # ---------------------------------------------------------------- changes
    def rebuild(self, local_order: list[int]) -> list[BucketSpec] | None:
        """Rank 0's ready order for everyone; the new plan if it differs from the current."""
        order = torch.tensor(local_order, dtype=torch.int64, device=self.device)
        comm.broadcast(order, 0, self.group, tag="rebuild")
        self.rebuilt = True
        self.ready_order = host.read(order, emulated=torch.tensor(local_order)).tolist()
        return self._changed()

    def adopt(self, order: list[int]) -> list[BucketSpec] | None:
        """A saved rebuild's ready order (a resumed run): the plan the run had, no rebuild
        after this process's first pass; the new plan if it differs from the current."""
        if sorted(order) != list(range(len(self.params))):
            raise ValueError(f"a saved bucket order must be a permutation of the "
                             f"{len(self.params)} trainable parameters, got {len(order)} entries")
        self.rebuilt, self.ready_order = True, list(order)
        return self._changed()

    def autotune_step(self, seconds: float) -> list[BucketSpec] | None:
        """Feed one measured synchronised backward; the new plan when the cap changes."""
        tuner = self.autotuner
        action = tuner.record(seconds)
        if action == "stay":
            return None
        if action == "decide":  # every rank adopts the choice that suits the slowest rank
            medians = torch.tensor(tuner.result.median_s, dtype=torch.float64,
                                   device=self.device)
            comm.all_reduce(medians, self.group, op=dist.ReduceOp.MAX, tag="autotune")
            tuner.decide(host.read(medians).tolist())
        self.cap_bytes = mb_to_bytes(tuner.current_mb)
        return self._changed()

    @property
    def tuning(self) -> bool:
        return self.autotuner is not None and not self.autotuner.done

    def _changed(self) -> list[BucketSpec] | None:
        specs = self.plan(self.ready_order)
        if [s.params for s in specs] != [b.spec.params for b in self.buckets]:
            return specs
        return None


class BucketAccess:
    """DataParallel's view of its layout (for reductions, planners and reports) and the
    housekeeping that works on the buckets (``zero_grad``, ``unwrap``)."""

    @property
    def buckets(self) -> list[Bucket]:
        return self._layout.buckets

    def where(self, i: int) -> tuple[Bucket, int]:
        """(bucket, slot) of trainable parameter ``i``."""
        return self._layout.where(i)

    @property
    def trainable_params(self) -> list[torch.nn.Parameter]:
        return list(self._params)

    @property
    def trainable_names(self) -> list[str]:
        return list(self._names)

    @property
    def bucket_plan(self) -> list[BucketSpec]:
        """The bucket assignment in use (launch order), as the planner sees it."""
        return self._layout.plan_in_use

    @property
    def param_specs(self) -> list[ParamSpec]:
        """Trainable parameters in registration order (tied weights once)."""
        return list(self._specs)

    @property
    def bucket_cap_bytes(self) -> int:
        return self._layout.cap_bytes

    @property
    def first_bucket_bytes(self) -> int:
        return self._layout.first_bytes

    @property
    def autotune_result(self) -> AutotuneResult | None:
        """Candidates, the slowest rank's median per candidate and the choice (``"auto"`` only)."""
        tuner = self._layout.autotuner
        return None if tuner is None else tuner.result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's ``zero_grad``: gradients to None by default; with
        ``set_to_none=False`` the buckets are zeroed in place and a None gradient stays None.
        Gradients a reduction holds (ZeroOptimizer's shards) are zeroed with them, as
        ``model.zero_grad()`` clears torch DDP's gradients whichever optimizer steps them."""
        self._reduction.prepare()
        self._reduction.zero_grad(set_to_none)
        for b in self._layout.buckets:
            if not b.buffer.untyped_storage().nbytes():  # released by a sharded reduction
                continue
            b.buffer.zero_()
            b.zeroed = True
            if not set_to_none:
                for p, view in zip(b.params, b.views):
                    if p.grad is not None:
                        p.grad = view
        if set_to_none:
            for p in self._params:
                p.grad = None

    def unwrap(self) -> torch.nn.Module:
        """Remove every hook and give gradients their own storage; returns the module."""
        for h in [*self._hooks, *getattr(self, "_accumulator_handles", ())]:
            h.remove()
        self._hooks.clear()
        self._accumulator_handles = []
        for b in self._layout.buckets:
            b.detach_grads()
        return self.module

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The module's own keys, or a torch DDP checkpoint's (``module.``-prefixed)."""
        state_dict = without_ddp_prefix(state_dict, self.module.state_dict(keep_vars=True))
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
