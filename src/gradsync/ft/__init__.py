"""Fault-tolerant training across replica groups, on torchft: failures do not stop the world.

A *replica group* is one torchrun job (a host, in netlab) running gradsync's exact
data parallelism inside it (ddp or ZeRO stages 1-3; with ``--sync diloco`` the
group is one DiLoCo worker and only its outer syncs go through a quorum,
``outer_sync.py``).
Across groups, every optimizer step goes through that step's *quorum*, decided
by torchft's lighthouse: survivors keep training when a group dies, and a
restarted or new group heals from a live peer (model, optimizer, schedule and
data position) at the next quorum. Nobody restarts but the group that failed.

What gradsync adds to torchft is the exact result (``docs/fault_tolerance.md``):

* the global batch of step ``s`` is a fixed block of the sampler's global order,
  whatever the quorum; it is dealt over the ranks of the groups in the quorum
  (``shares.py``), so a smaller quorum means more micro-batches per rank, not a
  smaller batch;
* gradients are summed with their item counts over the quorum and divided by the
  global count (``cross_reduce.py``), never averaged over participants;
* a step that does not commit (a group died mid-step) is redone by the next quorum
  on the same samples (``replica.py``; the loop restores the sampler).

So trained through any number of failures, the model is the uninterrupted run's
(float64 SGD: within 1e-12), and every sample is used exactly once per epoch.

torchft is an optional dependency (``pip install 'gradsync[ft]'``): ``requirement.py``
says so in one line when it is missing. Layering: ``ft`` sits above the engine and
the data layer and below ``train``, which calls it.
"""
