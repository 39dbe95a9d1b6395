"""What a strategy supplies to the synchronised-backward core (``core.py``).

``SyncedModule`` owns *when* gradients travel and what a user gets back; a
strategy (DataParallel's buckets, FSDP's units) supplies *how*, through the hooks
below. Each hook says when the core calls it. Kept apart from the state machine
so the protocol reads as one list.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import torch

from .param_groups import resolve_param_groups
from .replicas import ignored_names


def tensors_in(obj):
    """Every tensor in a (nested) tuple/list/dict/dataclass output."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            yield from tensors_in(getattr(obj, f.name, None))


@dataclass
class Collected:
    """What a strategy hands back once every gradient collective of a sync completed.

    header: the summed item-window header. used: the summed used-mask (one slot per
    tracked parameter; > 0 means used on some rank), present when
    ``find_unused_parameters``. missing: indices of parameters this rank tracks that
    never joined this pass (and are still trainable).
    """

    header: torch.Tensor
    used: torch.Tensor | None
    missing: list[int]


class SyncProtocol:
    """The hooks a :class:`~gradsync.engine.sync.core.SyncedModule` subclass provides."""

    def _synced_buffers(self) -> list[torch.Tensor]:
        ignore = ignored_names(self.module)
        return [b for n, b in self.module.named_buffers() if b.numel() and n not in ignore]

    def _run_forward(self, args, kwargs):
        return self.module(*args, **kwargs)

    def _set_aside(self) -> None:
        """Rule 2: move gradients held from before this window out of autograd's way."""

    def _take_back(self) -> None:
        """A pass that nothing joined: put what ``_set_aside`` moved back unchanged."""

    def _sync_open(self) -> None:
        """The first parameter joined a synchronised pass (launch the header, reset counts)."""

    def _sync_collect(self) -> Collected:
        raise NotImplementedError

    def _sync_complete(self, divisor: float, used: list[bool]) -> None:
        raise NotImplementedError

    def _sync_reset(self) -> None:
        """A sync failed after its collectives completed: forget this pass's state."""

    def _synced_grads(self) -> tuple[list[torch.Tensor], object, bool]:
        """After ``_sync_complete``: (the synchronised gradient this rank holds, the group
        it is sharded over, whether it is sharded). Loss scaling's overflow check reads
        it (``loss_scale.py``): a replicated gradient is the same on every rank; a
        sharded one needs its flag summed over the group."""
        raise NotImplementedError

    def _drop_grads(self) -> None:
        """Loss scaling found the synchronised gradient non-finite: drop it (``.grad``
        None, shards gone), so the step that follows changes nothing."""
        raise NotImplementedError

    def _hold_gradients(self) -> None:
        """Before an empty rank's backward through its graph: keep gradients where
        autograd cannot accumulate into them in place (what arrives is checked first)."""

    def _replay_forward(self) -> None:
        """Rule 5: the collectives of a forward this rank without data did not run."""

    def _replay_backward(self) -> None:
        """Rule 5: this rank's share of a backward's collectives, with zero gradients."""
        raise NotImplementedError

    def _param_names(self) -> list[str]:
        raise NotImplementedError

    def _optimizer_pieces(self) -> list[tuple[str | None, torch.Tensor]]:
        """(parameter name, tensor an optimizer of this model steps), in order."""
        raise NotImplementedError

    def param_groups(self, groups) -> list[dict]:
        """Optimizer parameter groups written with the model's parameter names, resolved
        to what ``self.parameters()`` steps (``param_groups.py``)::

            torch.optim.AdamW(model.param_groups([{"params": decay, "weight_decay": 0.1},
                                                  {"params": rest, "weight_decay": 0.0}]))
        """
        pieces = self._optimizer_pieces()
        return resolve_param_groups(groups, self._param_names(), pieces,
                                    {id(t): n for n, t in pieces if t.requires_grad},
                                    type(self).__name__)

    def _trainable(self) -> list[bool]:
        """Per used-mask slot: may this parameter receive a gradient now? (A parameter
        frozen after wrapping takes no part and is never reported missing.)"""
        raise NotImplementedError

    def _pass_started(self) -> None:
        """Every backward pass through this model begins (before any gradient)."""

    def _pass_over(self) -> None:
        """Every backward pass ends, joined or not, synchronised or not."""
