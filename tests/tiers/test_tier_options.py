"""Every built-in tier declares its options once, in its options model; the constructor agrees.

The cases are generated from the models: for every option, a valid value other than
its default (all given at once to one tier of each type, built three ways) and
invalid values from its type and bounds (``nan``, ``inf``, ``1e400``, one past each
bound, a 401-digit number, a fraction for a count...), each refused alike by the
registry's validation (what ``kvtier config show`` and config files use) and by the
constructor, with a ConfigError naming the option, before any thread starts.
"""

from __future__ import annotations

import inspect
import threading
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import annotated_types
import numpy as np
import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvtier.config import describe_config, load_config
from kvtier.errors import ConfigError
from kvtier.keys import KVGeometry, Namespace
from kvtier.tiers.base import SecondaryTier, TierContext
from kvtier.tiers.registry import builtin_tier_names, create_tier, resolve_tier_class, validate_tier_options

BLOCK = 4096
MAX_BYTES = 1 << 60  # kvtier.tiers.options.MAX_BYTES (kept literal: this file also runs against older trees)
# Options a generic value cannot exercise here, and why.
NOT_GENERATED = {("redis", "cluster"): "needs a Redis Cluster to construct (test_redis.py covers it)"}


def _base_spec(name: str, tmp_path: Path) -> dict[str, Any]:
    """Required options and the medium (nothing needs to answer: construction never waits for it)."""
    return {
        "fs": {"root": str(tmp_path / "fs-root")},
        "memory": {},
        "redis": {"url": "redis://127.0.0.1:1/0"},
        "s3": {"bucket": "kv-options", "endpoint": "http://127.0.0.1:1", "allow_http": True,
               "access_key_id": "k", "secret_access_key": "s"},
    }[name]  # fmt: skip


def _bounds(info: FieldInfo) -> dict[str, float]:
    found: dict[str, float] = {}
    for meta in info.metadata:
        for kind in ("gt", "ge", "lt", "le"):
            value = getattr(meta, kind, None)
            if value is not None and isinstance(meta, (annotated_types.BaseMetadata, annotated_types.Interval)):
                found[kind] = value
    return found


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _base_type(info: FieldInfo) -> Any:
    members = [m for m in _members(info.annotation) if m is not type(None)]
    return members[0] if len(members) == 1 else None


def _is_size(info: FieldInfo) -> bool:
    return any(type(m).__name__ == "BeforeValidator" for m in info.metadata)


def valid_other_value(info: FieldInfo) -> Any:
    """A valid value other than the default, or None if the type gives none generically."""
    base, default, bounds = _base_type(info), info.default, _bounds(info)
    if base is bool:
        return not default
    if typing.get_origin(info.annotation) in (typing.Union, types.UnionType) and isinstance(default, str):
        return False if bool in _members(info.annotation) else None  # e.g. direct_io: 'auto' -> false
    if base is int:
        if _is_size(info):
            return 64 * 2**20 if default is None else default * 2
        value = (default if isinstance(default, int) else int(bounds.get("ge", bounds.get("gt", 0)))) + 1
        return min(value, int(bounds.get("le", value)))
    if base is float:
        return 1.5 if default is None else default * 1.5 or 0.5
    return None


def invalid_values(info: FieldInfo) -> list[Any]:
    """Values the option's type and bounds refuse."""
    base, bounds = _base_type(info), _bounds(info)
    if base is int and _is_size(info):
        return [float("inf"), "1e400", "9" * 401, -1, 1.5, MAX_BYTES + 1, "lots", True]
    if base is int:
        out: list[Any] = [10**401, 2.5, float("nan"), "three"]
        if "ge" in bounds:
            out.append(int(bounds["ge"]) - 1)
        if "gt" in bounds:
            out.append(int(bounds["gt"]))
        if "le" in bounds:
            out.append(int(bounds["le"]) + 1)
        return out
    if base is float:
        out = [float("nan"), float("inf"), float("-inf"), "1e400", "inf", "soon"]
        if "gt" in bounds:
            out.append(bounds["gt"])
        if "ge" in bounds:
            out.append(bounds["ge"] - 1.0)
        if "le" in bounds:
            out.append(bounds["le"] * 2)
        return out
    if base is bool:
        return ["maybe", 2]
    if typing.get_origin(info.annotation) in (typing.Union, types.UnionType) and isinstance(info.default, str):
        return ["sometimes", 3.5]
    return []


def _fields(name: str) -> dict[str, FieldInfo]:
    model = resolve_tier_class(name).options_model
    assert model is not None and issubclass(model, BaseModel), f"{name}: no options model"
    return dict(model.model_fields)


INVALID_CASES = [
    pytest.param(name, field, value, id=f"{name}-{field}-{value!r:.24}")
    for name in builtin_tier_names()
    for field, info in _fields(name).items()
    if (name, field) not in NOT_GENERATED
    for value in invalid_values(info)
]


@pytest.fixture
def context() -> Iterator[TierContext]:
    ns = Namespace("options-test", KVGeometry.from_block_bytes(BLOCK))
    yield TierContext(np.zeros((4, BLOCK), dtype=np.uint8), BLOCK, ns)


@pytest.mark.parametrize("name", builtin_tier_names())
def test_the_constructor_takes_the_model_and_declares_no_option_itself(name: str) -> None:
    cls = resolve_tier_class(name)
    params = list(inspect.signature(cls.__init__).parameters.values())
    assert [(p.name, p.kind) for p in params] == [
        ("self", inspect.Parameter.POSITIONAL_ONLY),
        ("context", inspect.Parameter.POSITIONAL_ONLY),
        ("options", inspect.Parameter.POSITIONAL_ONLY),
        ("fields", inspect.Parameter.VAR_KEYWORD),
    ], params
    model = cls.options_model
    assert model is not None
    assert params[2].annotation in (f"{model.__name__} | None", model | None)
    assert model.model_config.get("extra") == "forbid" and model.model_config.get("allow_inf_nan") is False
    for field, info in model.model_fields.items():
        assert info.description, f"{name}: option {field!r} has no description (it is its documentation)"


def test_invalid_cases_cover_every_numeric_option() -> None:
    """The generator is not vacuous: every int/float/size/bool option of every tier gets cases."""
    for name in builtin_tier_names():
        for field, info in _fields(name).items():
            if _base_type(info) in (int, float, bool) and (name, field) not in NOT_GENERATED:
                assert invalid_values(info), f"{name}.{field}: no invalid values generated"


@pytest.mark.parametrize(("name", "field", "value"), INVALID_CASES)
def test_model_and_constructor_refuse_the_same_values(
    name: str, field: str, value: Any, context: TierContext, tmp_path: Path
) -> None:
    spec = {**_base_spec(name, tmp_path), field: value}
    with pytest.raises(ConfigError) as by_model:
        validate_tier_options({"type": name, **spec}, where="tiers[0]")
    assert f"option '{field}'" in str(by_model.value), str(by_model.value)
    threads = threading.active_count()
    with pytest.raises(ConfigError) as by_constructor:
        resolve_tier_class(name)(context, **spec)
    assert f"option '{field}'" in str(by_constructor.value), str(by_constructor.value)
    assert threading.active_count() == threads, "a thread was started before the options were checked"
    assert not (tmp_path / "fs-root").exists(), "the fs root was created before the options were checked"
    assert "Traceback" not in str(by_constructor.value) and "OverflowError" not in str(by_constructor.value)


@pytest.mark.parametrize("name", builtin_tier_names())
def test_every_option_reaches_the_tier_the_same_three_ways(
    name: str, context: TierContext, tmp_path: Path
) -> None:
    """One tier per way (registry spec, keywords, model instance) with every generated option
    changed from its default: each holds exactly what the model makes of the spec."""
    cls = resolve_tier_class(name)
    model = cls.options_model
    assert model is not None
    spec = _base_spec(name, tmp_path)
    changed = []
    for field, info in model.model_fields.items():
        value = valid_other_value(info)
        if value is not None and (name, field) not in NOT_GENERATED and field not in spec:
            spec[field] = value
            changed.append(field)
    assert changed, f"{name}: no option could be generated"
    expected = model.model_validate(spec)
    for field in changed:
        assert getattr(expected, field) != model.model_fields[field].default, f"{name}.{field} kept its default"
    built: list[SecondaryTier] = []
    try:
        built.append(create_tier({"type": name, **spec}, context))
        built.append(cls(context, **spec))  # type: ignore[call-arg]
        built.append(cls(context, expected))  # type: ignore[call-arg]
        for tier in built:
            assert tier.options == expected  # type: ignore[attr-defined]
            shown = tier.describe()
            for field in changed:
                if field not in ("max_bytes",):  # fs shows the resolved budget under max_bytes
                    assert field in shown, f"{name}: describe() does not show option {field!r}"
    finally:
        for tier in built:
            tier.shutdown()


@pytest.mark.parametrize("name", builtin_tier_names())
def test_a_model_instance_with_keyword_changes(name: str, tmp_path: Path) -> None:
    from kvtier.tiers.options import MAX_BYTES as max_bytes
    from kvtier.tiers.options import tier_options

    assert max_bytes == MAX_BYTES
    cls = resolve_tier_class(name)
    model = cls.options_model
    assert model is not None
    base = model.model_validate(_base_spec(name, tmp_path))
    field, info = next((f, i) for f, i in model.model_fields.items() if _base_type(i) in (int, float))
    other = valid_other_value(info)
    changed = tier_options(model, name, base, {field: other})
    assert getattr(changed, field) == getattr(model.model_validate({**_base_spec(name, tmp_path), field: other}), field)
    assert getattr(changed, field) != getattr(base, field)
    with pytest.raises(ConfigError, match=rf"option '{field}'"):
        tier_options(model, name, base, {field: float("nan")})
    with pytest.raises(ConfigError, match=rf"must be a {model.__name__}"):
        tier_options(model, name, {"a": 1}, {})  # type: ignore[arg-type]


def test_config_show_sizes_come_from_the_tier_classes(tmp_path: Path) -> None:
    from kvtier.tiers.format import HEADER_SIZE
    from kvtier.tiers.fs_layout import entry_bytes

    config = load_config(env={}, cli={
        "model": "tiny", "cpu_bytes": "16MiB",
        "tiers": [{"type": "fs", "root": str(tmp_path), "max_bytes": "1GiB"}, {"type": "memory"},
                  {"type": "memory", "max_bytes": 10 * (HEADER_SIZE + 2048) + 5}, {"type": "redis", "url": "redis://x"}],
    })  # fmt: skip
    info = describe_config(config)
    block = info["bytes_per_block"]
    fs, memory, small, redis = info["tiers"]
    assert fs["bytes_per_stored_block"] == entry_bytes(block) and fs["blocks"] == 2**30 // entry_bytes(block)
    assert memory["capacity_bytes"] == 256 * 2**20, "the memory tier's default capacity is its capacity"
    assert memory["bytes_per_stored_block"] == HEADER_SIZE + block
    assert small["blocks"] == (10 * (HEADER_SIZE + 2048) + 5) // (HEADER_SIZE + block)
    assert redis["capacity_bytes"] is None and redis["blocks"] is None
