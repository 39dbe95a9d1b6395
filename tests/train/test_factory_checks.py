"""Factories that cannot work are refused in one line before any worker starts."""

import subprocess
import sys

import pytest
from torch import nn

import gradsync as gs
from gradsync.factory import check_factory, load_factory


def needs_width(width):
    return nn.Linear(width, width)


def with_default(width=2):
    return nn.Linear(width, width)


@pytest.mark.parametrize("given,what,message", [
    (nn.Linear(2, 2), "model", "not a Linear instance"),
    ([1, 2, 3], "data", "not a list instance"),
    (lambda: nn.Linear(2, 2), "model", "define it at module level"),
    (needs_width, "model", "must take no arguments .* needs width"),
])
def test_unusable_factories_are_named(tmp_path, given, what, message):
    with pytest.raises(gs.UsageError, match=message):
        check_factory(given, what)
    with pytest.raises(gs.UsageError, match=message):  # gs.train says so before launching
        gs.train(gs.TrainConfig(out=str(tmp_path / "run"), steps=1), **{what: given})
    assert not (tmp_path / "run").exists()


def test_a_nested_function_is_refused():
    def build():
        return nn.Linear(2, 2)

    with pytest.raises(gs.UsageError, match="nested function"):
        check_factory(build, "model")


def test_module_level_factories_pass():
    check_factory(with_default, "model")
    assert load_factory(f"{__name__}:with_default") is with_default
    with pytest.raises(gs.UsageError, match="must take no arguments"):
        load_factory(f"{__name__}:needs_width")


@pytest.mark.timeout(60)
def test_a_factory_from_stdin_is_refused():
    code = ("import gradsync as gs\nfrom torch import nn\n"
            "def build():\n    return nn.Linear(2, 2)\n"
            "try:\n    gs.train(gs.TrainConfig(out='unused', steps=1), model=build)\n"
            "except gs.UsageError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                       timeout=50)
    assert "defined in an interactive __main__" in r.stdout, r.stderr[-2000:]


def returns_data():
    from tests.train.factories import regression64
    return regression64()


@pytest.mark.timeout(120)
def test_a_model_factory_failing_in_the_workers_leaves_no_empty_run_directory(tmp_path):
    """The factory is called in the workers, after the run directory and its lock were
    made: a run that never wrote anything removes the directory it created; a directory
    that was there is left as it was (empty: the lock file is removed at exit)."""
    fresh, kept = tmp_path / "fresh" / "run", tmp_path / "kept"
    kept.mkdir()
    for out in (fresh, kept):
        with pytest.raises(gs.UsageError, match="returned TrainData, not a torch.nn.Module"):
            gs.train(gs.TrainConfig(out=str(out), steps=1, workers=2, global_batch=4,
                                    micro_batch=2),
                     model=f"{__name__}:returns_data", data="tests.train.factories:regression64")
    assert not fresh.exists() and fresh.parent.exists()
    assert kept.is_dir() and list(kept.iterdir()) == []  # the lock is removed at exit
