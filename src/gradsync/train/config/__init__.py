"""What a run is asked to do: the flag table, the config resolved once, the run planned.

``train_config.py`` is the flag table, :class:`TrainConfig` (one field, one flag, one help
line), and ``flags.py`` turns it into argparse flags and back. ``resolve.py`` checks
every flag once and returns the frozen :class:`RunConfig` the run reads, in sections
(run, batch, optim, sync, ft, observe) with every value that follows from the flags
alone. ``plan.py`` is :func:`plan_run`, used by the launcher's preflight and by a worker
group's rank 0 alike: the run directory prepared and the run planned on its number of
workers (the accumulation count, fresh or continued, the refusals that need the world).
The checks that need a rule of their own each have a file, called by ``resolve`` only:
flags that mean something in one mode (``mode_flags.py``), ``--data-parts``
(``parts_flags.py``), ``--trace-steps`` (``trace_flags.py``); fault tolerance's refusals
live with it (``ft/flags.py``).
"""
