"""Layer 5, local: local-update methods that sync parameters, not gradients.

``diloco`` is DiLoCo and Local SGD (arXiv 2311.08105): H local steps, then an
outer step on the item-weighted average of where the workers went, with when syncs
happen (warm-up, an H that grows as the learning rate decays, the outer momentum
ramp) and the synchronous steps before local ones; ``exchange`` what a sync is made
of and sends (fragments, the unit of a sync, with their global copy; the summed
pseudo-gradient, its items, the buffers); ``streaming`` is Streaming DiLoCo (arXiv
2501.18512), fragments synced at staggered steps, with its eager updates (arXiv
2502.12996). Not exact by design. Imports ``compress``, ``sync`` and ``transport``,
never ``replicated`` or ``sharded``.
"""
