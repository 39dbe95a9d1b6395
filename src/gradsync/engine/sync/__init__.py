"""Layer 1, sync: the synchronised backward that every strategy shares.

``core`` is the pass state machine (when gradients travel, ``no_sync``, the
DDP-compatibility rules); a strategy plugs in through ``protocol``. The exact
divisor lives in ``item_window`` (the item count of an accumulation window,
carried with the gradients); ``arrivals`` and ``accumulators`` say when a
parameter's gradient is complete; ``join`` handles ranks that run out of data;
``replicas`` establishes that replicas start identical and ``drift`` checks they
stay so; ``param_groups`` resolves optimizer groups named by parameter;
``batchnorm`` is SyncBatchNorm. Imports only ``transport``.
"""
