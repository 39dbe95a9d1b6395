"""Layer 5, sharded: ZeRO's partitioning (arXiv 1910.02054, section 5).

``shards`` is the pure arithmetic of flat buffers cut into equal per-rank pieces;
``shard_view`` shows a shard to an optimizer as one tensor per parameter piece;
``zero`` is ZeroOptimizer (stages 1 and 2 over DataParallel); ``fsdp`` is stage 3
(FullyShardedDataParallel); ``clip`` clips over every rank's shards;
``checkpoint`` saves shards and re-cuts them on load, for any world size;
``shard_memory`` reports what a rank holds. Imports ``replicated`` and below,
never ``local``.
"""
