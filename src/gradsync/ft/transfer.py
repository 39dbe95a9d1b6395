"""What a healing group receives from a live peer: this rank's own part of the state.

torchft sends it from rank ``j`` of a healthy group to rank ``j`` of the group that
heals, over HTTP, from inside its quorum thread on the sender. So the state must
be readable without a collective (the sender's other ranks are not in step with
that thread): each rank's *local* part. Groups have the same size and the same
strategy, so rank ``j``'s shard layout is the same in every group.

* ddp: the whole module and the whole optimizer state (each rank holds both);
* zero1 / zero2: the whole module (parameters are replicated) and this rank's
  optimizer shard, master slices included (``ZeroOptimizer.state_dict``);
* zero3: the module wrapper's own state (this rank's parameter shards) and its
  optimizer shard.

Loading must not be a collective either: torchft decides healing per group rank
(at a fresh job's first quorum it spreads the sources, so rank 0 of a group may
heal from one peer while rank 1 is itself a source). So ZeRO's optimizer shard is
loaded without its all-gather of the parameters (``gather=False``): the full
parameters arrive in the module's own state, which every rank holds whole; zero3's
parameter shards load through ``nn.Module.load_state_dict`` of the wrapper's own
keys, also without a collective. The loaded optimizer must stay the one the LR
scheduler sets (``ZeroOptimizer.load_state_dict`` keeps its param groups): a healed
rank that kept the sender's warm-up rate ended zero2 groups 2e-2 from the
uninterrupted run (``tests/ft/test_zero_groups.py``).
"""

from __future__ import annotations

import copy

from ..engine.sharded.zero import ZeroOptimizer
from ..engine.strategy.exact import FullyShardedStrategy


def _holder(strategy):
    """The module whose ``state_dict`` is this rank's own part of the parameters."""
    return strategy.model if isinstance(strategy, FullyShardedStrategy) else strategy.module


def local_state(strategy) -> dict:
    """This rank's part of the model and optimizer, copied (the sender keeps training)."""
    return {"model": {k: v.detach().clone() for k, v in _holder(strategy).state_dict().items()},
            "optimizer": copy.deepcopy(strategy.optimizer.state_dict()),
            "extra": copy.deepcopy(strategy.extra_state())}


def load_local_state(strategy, state: dict) -> None:
    """Load what :func:`local_state` produced on the same rank of a peer group."""
    _holder(strategy).load_state_dict(state["model"])
    if isinstance(strategy.optimizer, ZeroOptimizer):
        strategy.optimizer.load_state_dict(state["optimizer"], gather=False)
    else:
        strategy.optimizer.load_state_dict(state["optimizer"])
    strategy.load_extra_state(state.get("extra") or {})
