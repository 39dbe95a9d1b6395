"""Layer 5, local: local-update methods that sync parameters, not gradients.

``diloco`` is DiLoCo and Local SGD (arXiv 2311.08105): H local steps, then an
outer step on the item-weighted average of where the workers went; ``streaming``
is Streaming DiLoCo (arXiv 2501.18512), fragments synced at staggered steps;
``fragments`` the unit of a sync; ``schedule`` when syncs happen (warm-up, an H
that grows as the learning rate decays, the outer momentum ramp) and ``warmup``
the synchronous steps before local ones; ``eager`` streaming's eager updates (arXiv
2502.12996). Not exact by design. Imports ``compress``,
``sync`` and ``transport``, never ``replicated`` or ``sharded``.
"""
