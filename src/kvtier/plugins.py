"""Loading out-of-tree classes (eviction policies, secondary tiers) by import path."""

from __future__ import annotations

import importlib
from typing import Any

from kvtier.errors import ConfigError


def load_class(import_path: str, base: type, what: str, hint: str = "") -> Any:
    """The class named by ``"package.module:ClassName"``, checked to subclass ``base``.

    ``what`` names the kind of plugin in error messages ("eviction policy",
    "tier"); ``hint`` is appended when the module fails to import.
    """
    module_name, sep, class_name = import_path.partition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(f"{what} import path {import_path!r} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what} {import_path!r}: module {module_name!r} failed to import: {exc}.{hint}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        article = "an" if base.__name__[:1] in "AEIOU" else "a"
        raise ConfigError(f"{import_path!r} does not name {article} {base.__name__} subclass")
    return cls
