"""What a run is asked to do: :class:`TrainConfig`, its command-line flags, every flag check.

``train_config.py`` is the flag table (one field, one flag, one help line) and the checks
made when a config is built; ``flags.py`` turns it into argparse flags and back. The
checks that need a rule of their own each have a file: flags that mean something in one
mode only (``mode_flags.py``), ``--data-parts`` (``parts_flags.py``), ``--trace-steps``
(``trace_flags.py``), and the worker counts that can carry a continued run's global
batch (``splits.py``). Fault tolerance's refusals live with it (``ft/flags.py``).
"""
