"""``--collectives auto``, the default, decided from torchrun's environment alone.

Claims: hierarchical exactly when there are several hosts of several ranks each
(GROUP_WORLD_SIZE x LOCAL_WORLD_SIZE = WORLD_SIZE), native otherwise (one host, one
rank per host, uneven hosts, a missing or malformed environment, a process group of
its own); local updates keep native (a worker per host would change the algorithm);
compression combines with auto and hierarchical but not with the reference
algorithms; the run's description says what auto chose. A one-host ``gs.spawn``
resolving to native: ``test_hierarchical_compress.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from gradsync.engine.strategy.options import COLLECTIVES, SyncOptions, auto_collectives
from gradsync.engine.transport.algorithms.topology import hosts_in_env
from gradsync.errors import UsageError
from gradsync.rundir import sync_description
from gradsync.train.config.train_config import TrainConfig


def _env(world, local=None, hosts=None):
    env = {"WORLD_SIZE": str(world)}
    if local is not None:
        env["LOCAL_WORLD_SIZE"] = str(local)
    if hosts is not None:
        env["GROUP_WORLD_SIZE"] = str(hosts)
    return env


@pytest.mark.parametrize("env,hosts,choice", [
    (_env(8, 4, 2), (2, 4), "hierarchical"),   # two hosts of four
    (_env(6, 2, 3), (3, 2), "hierarchical"),   # three hosts of two
    (_env(8, 4), (2, 4), "hierarchical"),      # GROUP_WORLD_SIZE missing: WORLD / LOCAL
    (_env(4, 4, 1), (1, 4), "native"),         # one host (gradsync train, gs.spawn)
    (_env(4, 1, 4), (4, 1), "native"),         # one rank per host: a flat ring already
    (_env(1, 1, 1), (1, 1), "native"),
    (_env(6, 4, 2), None, "native"),           # hosts of 4 and 2: no two-level layout
    (_env(6, 2, 2), None, "native"),           # the same job seen from the smaller host
    ({}, None, "native"),                      # not launched by torchrun
    ({"WORLD_SIZE": "x", "LOCAL_WORLD_SIZE": "2"}, None, "native"),
    (_env(8, 0, 2), None, "native"),
])
def test_auto_decides_from_the_environment(env, hosts, choice):
    assert hosts_in_env(env) == hosts
    assert auto_collectives(env) == choice


def test_auto_on_a_group_of_its_own_is_native():
    assert auto_collectives(_env(8, 4, 2), group=object()) == "native"


def test_auto_is_the_default_and_resolves_per_method():
    assert SyncOptions().collectives == "auto" and COLLECTIVES[0] == "auto"
    assert {f.name: f.default for f in dataclasses.fields(TrainConfig)}["collectives"] == "auto"
    two = _env(8, 4, 2)
    assert SyncOptions().resolved(env=two).collectives == "hierarchical"
    assert SyncOptions(compress="int8").resolved(env=two).collectives == "hierarchical"
    assert SyncOptions().resolved(env=_env(4, 4, 1)).collectives == "native"
    assert SyncOptions(method="diloco").resolved(env=two).collectives == "native"
    named = SyncOptions(collectives="ring")
    assert named.resolved(env=two) is named


def test_compression_composes_with_hierarchical_not_with_reference_algorithms():
    for collectives in ("auto", "native", "hierarchical"):
        SyncOptions(compress="int8", collectives=collectives)
        SyncOptions(compress="powersgd:2", collectives=collectives)
    for collectives in ("ring", "tree", "server"):
        with pytest.raises(UsageError, match=f"--collectives {collectives} do not combine"):
            SyncOptions(compress="bf16", collectives=collectives)
    SyncOptions(method="diloco", compress="int8")  # auto: a worker per rank, compressed
    with pytest.raises(UsageError, match="pseudo-gradients between hosts exactly"):
        SyncOptions(method="diloco", compress="int8", collectives="hierarchical")


@pytest.mark.parametrize("config,chosen,text", [
    ({"collectives": "auto"}, "native", "exact, native collectives (auto)"),
    ({"collectives": "auto"}, "hierarchical", "exact, hierarchical collectives (auto)"),
    ({"collectives": "auto"}, None, "exact, collectives chosen by auto"),
    ({}, None, "exact"),
    ({"collectives": "hierarchical", "compress": "int8"}, None,
     "int8-compressed gradients across hosts, exact inside each, hierarchical collectives "
     "(not exact)"),
    ({"collectives": "auto", "compress": "int8"}, "native",
     "int8-compressed gradients, native collectives (auto) (not exact)"),
])
def test_the_description_says_what_auto_chose(config, chosen, text):
    assert sync_description(config, chosen) == text
