"""The error hierarchy as users import it."""

from __future__ import annotations

import inspect

import kvtier
import kvtier.errors


def test_every_error_class_is_exported_from_kvtier() -> None:
    """Regression (review, 2026-12-03): ``from kvtier import TierDrainTimeout`` (raised by
    ``reset_cache()``) failed; every other class of ``kvtier.errors`` was exported."""
    classes = {
        name for name, value in vars(kvtier.errors).items()
        if inspect.isclass(value) and issubclass(value, kvtier.errors.KvtierError)
        and value.__module__ == kvtier.errors.__name__
    }  # fmt: skip
    assert "TierDrainTimeout" in classes
    assert classes <= set(kvtier.__all__), sorted(classes - set(kvtier.__all__))
    assert all(getattr(kvtier, name) is getattr(kvtier.errors, name) for name in classes)
