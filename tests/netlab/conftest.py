"""Netlab tests need root (network namespaces); without it they skip, saying why."""

import pytest

from gradsync.netlab import unavailable_reason

REASON = unavailable_reason()


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    for item in items:
        if "tests/netlab" in str(item.fspath) and not item.get_closest_marker("no_root"):
            item.add_marker(pytest.mark.skip(reason=REASON))


def pytest_configure(config):
    config.addinivalue_line("markers", "no_root: runs without root (checks the refusal)")
