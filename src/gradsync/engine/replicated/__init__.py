"""Layer 4, replicated: every rank holds the whole model.

``data_parallel`` is DataParallel (hooks, buckets, the exact ``num_items``
backward), ``ddp_compat`` accepts torch DDP's keywords and comm hooks,
``precision`` defines MixedPrecision, ``mixed_optimizer`` is plain data
parallelism with bf16 compute and fp32 master weights, and ``memory_report``
counts the bytes a rank holds beside ZeRO's formulas for them. Imports the
layers below (``compress`` for DDP comm hooks that compress).
"""
