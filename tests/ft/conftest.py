"""The uninterrupted reference run, once per test file (tests/ft/helpers.py)."""

import pytest

pytest.importorskip("torchft")

from .helpers import straight_run  # noqa: E402


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return straight_run(tmp_path_factory.mktemp("straight"))
