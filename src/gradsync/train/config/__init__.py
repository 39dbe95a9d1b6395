"""What a run is asked to do: the flag table, the config resolved once, the run planned.

``train_config.py`` is the flag table, :class:`TrainConfig` (one field, one flag, one help
line), and ``flags.py`` turns it into argparse flags and back; ``file.py`` reads and writes
the same flags as a TOML file (``--config``, ``--print-config``). ``resolve.py`` checks
every flag once and returns the frozen :class:`RunConfig` the run reads
(``run_config.py``), in sections (run, batch, optim, sync, ft, observe, checkpoints,
task) with every value that follows from the flags alone. ``plan.py`` is
:func:`plan_run`, used by the launcher's preflight and by a worker group's rank 0
alike: the run directory prepared and the run planned on its number of workers (the
accumulation count, fresh or continued, the refusals that need the world).
Every refusal of a flag lives in ``resolve.py``, made once: ranges and choices, and the
rules with a story (flags of a mode that is off, what ``--ft-groups`` cannot carry yet,
``--data-parts``, ``--trace-steps``); what needs the workers is ``plan.py``'s.
"""
