"""`--strategy` reads the registry when the parser is built, not when modules are imported.

A strategy registered after ``gradsync.train.config.train_config`` was imported (as
``benchmarks/slow_link_worker.py`` registers ``torch-ddp``) must be a choice of
the parser built afterwards and a valid ``TrainConfig``, whatever the import order.
"""

import pytest

from gradsync.cli import build_parser
from gradsync.engine.strategy.registry import STRATEGIES, register_strategy
from gradsync.errors import UsageError
from gradsync.train.config import flags, train_config  # imported before the registration below


def test_a_strategy_registered_after_import_is_a_choice(capsys):
    register_strategy("late-ddp", STRATEGIES["ddp"])
    try:
        parser = build_parser()
        args = parser.parse_args(["train", "--strategy", "late-ddp", "--steps", "2"])
        assert args.strategy == "late-ddp"
        assert flags.from_args(args).strategy == "late-ddp"
        with pytest.raises(SystemExit):
            parser.parse_args(["train", "--help"])
        assert "late-ddp" in capsys.readouterr().out
    finally:
        del STRATEGIES["late-ddp"]
    with pytest.raises(SystemExit):  # gone from the registry: gone from a new parser
        build_parser().parse_args(["train", "--strategy", "late-ddp"])
    assert "invalid choice: 'late-ddp'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="unknown strategy 'late-ddp'"):
        train_config.TrainConfig(strategy="late-ddp")
