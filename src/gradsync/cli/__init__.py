"""`gradsync <command>`: one module per subcommand, each with ``register(subparsers)``.

A subcommand module exposes ``register(subparsers) -> argparse.ArgumentParser`` and
sets ``run`` as the parser default: ``run(args) -> int`` returns the exit code.
Bad input raises :class:`gradsync.errors.UsageError`; it is printed as one line
and the exit code is 2, like argparse's own errors. A file that cannot be written
(a full disk, an I/O error) raises :class:`gradsync.errors.StorageError`: one line
naming the file and the command to run again, exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

from ..errors import StorageError, UsageError
from ..sigint import held

# (module name under gradsync.cli, help line). Adding a command is one line here.
COMMANDS: list[tuple[str, str]] = [
    ("train", "train a model data-parallel on K workers (the main job)"),
    ("verify", "check exactness against one process, or audit the sampler"),
    ("plan", "plan before launching: memory, batch recipe, communication cost"),
    ("simulate", "simulate one step's backward/all-reduce overlap and sweep bucket sizes"),
    ("calibrate", "measure this machine's alpha/beta and the model's backward; write a profile"),
    ("report", "write a run's report.html (loss, throughput, step timeline, memory, drift)"),
    ("export", "write a run's trained model as safetensors, a torch state dict or hf"),
    ("eval", "score a run's checkpoint on the held-out set, exactly, with the run's workers"),
    ("netlab", "emulated hosts joined by rate-limited links: run, calibrate, check, clean"),
    ("lighthouse", "torchft's lighthouse for a cluster job of replica groups, its settings "
                   "derived from the job"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync",
        description="Exact, overlapped data-parallel training for PyTorch.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, help_line in COMMANDS:
        module = importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
        module.register(sub, help_line)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:  # building the parser imports torch: seconds in which Ctrl-C may come, and
        with held():  # torch's import would swallow it (gradsync.sigint): raised after
            parser = build_parser()
    except KeyboardInterrupt:
        print("gradsync: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    # the command line as given: hints that repeat it ("continue with: ...") and the
    # one-machine --ft-groups, which passes it on to its groups, read it from here, so
    # main(argv) called from Python repeats argv, not the calling program's sys.argv
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return run_guarded(args.command, args.argv, lambda: args.run(args))


def run_guarded(command: str, argv: list[str], run) -> int:
    """``run()``'s exit code; a UsageError is one line and exit code 2, a StorageError one
    line with the command to run again, an interrupt exit code 130."""
    try:
        return int(run() or 0)
    except UsageError as e:
        print(f"gradsync {command}: error: {e}", file=sys.stderr)
        return 2
    except StorageError as e:
        print(f"gradsync {command}: error: {e}; once that is fixed, run again: "
              f"gradsync {shlex.join(argv)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"gradsync {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
