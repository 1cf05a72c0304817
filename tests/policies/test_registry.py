"""The policy registry: built-ins by name, out-of-tree classes by import path."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.policies import ARCPolicy, LRUPolicy, create_policy, resolve_policy


def test_builtins_by_name() -> None:
    assert isinstance(create_policy("lru", 4), LRUPolicy)
    arc = create_policy("arc", 4)
    assert isinstance(arc, ARCPolicy) and arc.capacity == 4


def test_out_of_tree_class_by_import_path() -> None:
    assert resolve_policy("kvtier.policies.lru:LRUPolicy") is LRUPolicy


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("fifo", "unknown eviction policy 'fifo'"),
        ("no_such_module_xyz:Policy", "failed to import"),
        ("kvtier.policies.lru:Nope", "does not name an EvictionPolicy subclass"),
        ("kvtier.keys:KVGeometry", "does not name an EvictionPolicy subclass"),
        # regression (2026-12-06, review): accepted, then "TypeError: Can't instantiate abstract class"
        # from the bench or the replay, "an input no check caught"
        ("kvtier.policies.base:EvictionPolicy", r"is abstract: it does not implement clear, evict, .*touch"),
    ],
)
def test_bad_names_raise_config_errors(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_policy(spec)
