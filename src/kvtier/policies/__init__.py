"""Eviction policies for the CPU primary tier, by name or by import path."""

from __future__ import annotations

import inspect

from kvtier.errors import ConfigError
from kvtier.plugins import load_class
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.return_time import ReturnTimePolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy, "return-time": ReturnTimePolicy}

DEFAULT_POLICY = "return-time"
"""The CPU tier's policy when none is configured."""

__all__ = ["DEFAULT_POLICY", "POLICIES", "ARCPolicy", "EvictionPolicy", "LRUPolicy", "ReturnTimePolicy",
           "create_policy", "resolve_policy"]


def resolve_policy(name_or_path: str) -> type[EvictionPolicy]:
    """A policy class from a registered name (``"lru"``, ``"arc"``) or ``"module:Class"``."""
    if name_or_path in POLICIES:
        return POLICIES[name_or_path]
    if ":" not in name_or_path:
        raise ConfigError(
            f"unknown eviction policy {name_or_path!r}: use one of {sorted(POLICIES)} "
            "or an import path 'package.module:ClassName'"
        )
    cls: type[EvictionPolicy] = load_class(name_or_path, EvictionPolicy, "eviction policy")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ConfigError(f"eviction policy {name_or_path!r} is abstract: it does not implement {missing}")
    return cls


def create_policy(name_or_path: str, capacity: int) -> EvictionPolicy:
    return resolve_policy(name_or_path)(capacity)
