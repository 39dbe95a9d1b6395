"""Layer 6, strategy: "how this run synchronises" as one object for the loop.

``base`` is the Strategy interface the training loop, checkpoints and reports
talk to; ``exact`` the exact strategies (ddp, zero1-3); ``inexact`` compressed
buckets and local updates; ``builders`` make each from a module; ``registry``
maps ``--strategy`` names to builders and is read when a parser is built;
``options`` is SyncOptions (``--sync``, ``--compress``, ``--collectives``).
The top layer: it may import every other.
"""
