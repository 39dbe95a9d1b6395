"""One replica group of a one-machine ``gradsync train --ft-groups N``: a job of its own.

``cli/train_groups.py`` starts each group as ``python -m gradsync.cli.train_group`` and
sends it, on its standard input, the job: the config the command resolved (the group's
index, the lighthouse and the group's run directory filled in), the command as the user
gave it and the run directory it names. Pickled over a pipe the launcher itself opened
to its own child, nothing on disk; the group never parses a command line, so every
flag is checked once, by the command, whatever the number of groups. The group then
runs :func:`gradsync.cli.train.train_job` as ``gradsync train`` runs a job: preflight,
its workers, the outcome in one line, with the hints naming the user's command.
"""

from __future__ import annotations

import pickle
import sys


def main() -> int:
    from . import run_guarded
    from .train import train_job

    cfg, argv, out = pickle.load(sys.stdin.buffer)  # the launcher's own pipe (above)
    return run_guarded("train", argv, lambda: train_job(cfg, argv, out))


if __name__ == "__main__":
    sys.exit(main())
