"""The micro-batches of a step, collated in the training process or by DataLoader workers.

``--loader-workers 0`` (the default) collates each micro-batch in the training process
when the step reaches it, as before this flag existed. ``--loader-workers N`` hands the
step's micro-batches to a ``torch.utils.data.DataLoader`` with N worker processes: the
``__getitem__`` calls and the collate function (tokenisation, decoding, augmentation --
what makes a dataset slow) run there, ahead of the forward that needs them.

The decisions:

* **The step sampler's order, exactly.** The DataLoader does not sample: its batch
  sampler is fed, at the start of each step, this rank's micro-batches as the step
  coordinator dealt them (``step/coordinator.py``), in order, and it yields exactly those.
  A deal is decided at its step -- the speed balancer moves samples by what it measured,
  a quorum deals over the groups alive -- so the loader is fed one step at a time: its
  workers collate micro-batch k + 1, ... while micro-batch k computes (with an
  accumulation of 1 there is one micro-batch, and the overlap is with the step's
  statistics, not with the next step). Same samples, same collate function, same order:
  a deterministic dataset trains bit for bit as with ``--loader-workers 0`` (tested).
* **The training RNG is untouched.** A DataLoader draws its workers' base seed from
  torch's global generator unless it is given one; here it is given its own (seeded by
  ``--seed`` and the rank), so dropout and everything else that draws from the global
  generator draw the same numbers whatever the number of loader workers. A dataset that
  draws random numbers in ``__getitem__`` draws them in the loader worker, from that
  worker's generator (torch's rule: base seed + worker id), as in any DataLoader: such
  augmentation differs between 0 and N workers, and between N and M.
* **Pinned memory** on a GPU: the DataLoader pins each batch in its own thread, so the
  step's ``pin_memory().to(device, non_blocking=True)`` (``engine/transport/host.batch_to``)
  finds it pinned and copies at once. On the CPU nothing is pinned.
* Workers persist for the run (``persistent_workers``), are forked from the training
  process (the dataset is not pickled), set to one thread each (torch's default for
  them), and are shut down when the session closes. ``gradsync plan memory
  --loader-workers N`` counts the batches they hold.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

PREFETCH = 2
"""Micro-batches each loader worker collates ahead (torch's ``prefetch_factor``)."""


def _context():
    """Fork where there is fork: the training worker itself runs in a process its launcher
    started from a forkserver, whose start method the DataLoader would otherwise inherit --
    a new interpreter importing torch for each loader worker (13 s for the first step here,
    against 0.15 s forked) and the dataset pickled to it."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork") if "fork" in methods else None


class _Feed:
    """The DataLoader's batch sampler: the index lists of the current step, in order."""

    def __init__(self):
        self.lists: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.lists))


class StepBatches:
    """This step's micro-batches of ``dataset`` through ``collate`` (see the module
    docstring); ``workers`` 0: in this process."""

    def __init__(self, dataset, collate, workers: int, device: torch.device, seed: int = 0):
        self.dataset, self.collate, self.workers = dataset, collate, workers
        self._loader = self._it = None
        if workers:
            self._feed = _Feed()
            self._loader = DataLoader(
                dataset, batch_sampler=self._feed, num_workers=workers, collate_fn=collate,
                pin_memory=device.type == "cuda", prefetch_factor=PREFETCH,
                persistent_workers=True, generator=torch.Generator().manual_seed(seed),
                multiprocessing_context=_context())

    def step(self, micro: list[list[int]]) -> Iterator:
        """The step's micro-batches (``micro``: this rank's index lists), as (input,
        target) in that order; with workers, handed to them now."""
        if not self.workers:
            return (self.collate([self.dataset[i] for i in idx]) for idx in micro)
        self._feed.lists = [list(idx) for idx in micro]
        self._it = iter(self._loader)  # persistent workers: the same processes, re-fed
        return self._take(len(micro))

    def _take(self, n: int) -> Iterator:
        for _ in range(n):
            yield next(self._it)

    def close(self) -> None:
        it, self._it, self._loader = self._it, None, None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
