"""One optimizer step: the global batch dealt, cut into micro-batches, reduced exactly, committed.

``train_step.py`` takes one step (and the held-out evaluation): the block dealt over the
ranks, ``backward(loss, num_items)`` per micro-batch, the one statistics gather that
decides alike on every rank whether the update may happen (a NaN stops or skips it), the
update and its metrics line; ``monitor.py`` watches the held-out figures between steps
(the best so far for ``--keep-best``, the patience of ``--early-stop``); ``straggler.py``
is the emulated slow worker (``--straggler``) that ``--balance`` is tried against.
"""
