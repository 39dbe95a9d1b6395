"""Layer 0, transport: how bytes move between ranks.

``comm`` is the one door every collective goes through (tests count collectives
there and the tracer observes them, without patching torch); ``comm_thread``
runs blocking collectives in order on a background thread, so reference
algorithms and compressors overlap backward like an async all-reduce;
``shard_comm`` chooses, per backend and from measurements, how sharded
strategies reduce-scatter and gather flat buffers; ``algorithms`` holds the
reference ring, tree, parameter-server and two-level collectives on
point-to-point messages; ``tracing`` records spans (the collectives through
``comm``'s observer door). Nothing here knows about models or gradients.
"""
