"""ZeRO stage 3: parameters sharded too, gathered one unit at a time.

``wrapper`` is FullyShardedDataParallel; ``units`` decides which parameters share
a flat buffer; ``gather`` when a unit's full parameters exist; ``reduce`` the
gradient reductions in one fixed order on every rank; ``state`` the consolidated
state dict out and in; ``placeholder`` what a module attribute holds while its
unit is sharded (it answers metadata questions and refuses to compute).
"""
