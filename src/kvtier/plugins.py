"""Loading out-of-tree classes (eviction policies, secondary tiers) by import path.

An import path is code the local user chose to run (it is trusted as code), but
what that code does while importing is not under kvtier's control: any exception
it raises (SyntaxError, NameError, RuntimeError, a ``sys.exit()``) is turned into
one :class:`~kvtier.errors.ConfigError` naming the import path, the module and
the error, never a traceback. Called once per name while a configuration is
validated or a manager is built; any thread.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvtier.errors import ConfigError, exception_text, interrupt_behind
from kvtier.units import shown

_MAX_PATH = 300
"""The longest import path accepted; a longer one is refused, shown shortened."""


def _error_text(exc: BaseException) -> str:
    """``SyntaxError: invalid syntax (plug.py, line 3)``: the error's type and first line, at most 300 characters."""
    text = " ".join(exception_text(exc).split())
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


def load_class(import_path: str, base: type, what: str, hint: str = "") -> Any:
    """The class named by ``"package.module:ClassName"``, checked to subclass ``base``.

    ``what`` names the kind of plugin in error messages ("eviction policy",
    "tier"); ``hint`` is appended when the module (or one it needs) is not found. Raises
    :class:`ConfigError` for a malformed path, a module that is missing or fails
    to import for any reason, and a name that is not a ``base`` subclass.
    KeyboardInterrupt propagates, also one Python wrapped in another error. A path that is not a
    string, is longer than 300 characters or holds an '@' or a '://' (maybe a URL with a password)
    is refused without being shown.
    """
    if not isinstance(import_path, str):
        raise ConfigError(
            f"{what} import path must be a string 'package.module:ClassName', got a {type(import_path).__name__}"
        )
    if "@" in import_path or "://" in import_path:
        raise ConfigError(f"{what} import path {shown(import_path)} must look like 'package.module:ClassName'")
    if len(import_path) > _MAX_PATH:
        raise ConfigError(
            f"{what} import path {import_path[:40]!r}... ({len(import_path)} characters) is longer than "
            f"{_MAX_PATH} characters: give it as 'package.module:ClassName'"
        )
    module_name, sep, class_name = import_path.partition(":")
    if not sep or not module_name.strip() or not class_name.strip():
        raise ConfigError(f"{what} import path {import_path!r} must look like 'package.module:ClassName'")
    if module_name.startswith(".") or not all(part.isidentifier() for part in module_name.split(".")):
        raise ConfigError(
            f"{what} import path {import_path!r}: {module_name!r} is not an absolute module name: "
            "give it as 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{what} {import_path!r}: module {module_name!r} failed to import: {exception_text(exc)}.{hint}"
        ) from None
    except BaseException as exc:  # the module's own code failed (even a BaseException of its own): say what
        if isinstance(exc, (KeyboardInterrupt, GeneratorExit)):
            raise
        interrupt = interrupt_behind(exc)
        if interrupt is not None:  # Ctrl-C while importing, wrapped by Python: not the module's fault
            raise interrupt from None
        raise ConfigError(
            f"{what} {import_path!r}: importing module {module_name!r} raised {_error_text(exc)}: fix the module"
        ) from None
    try:
        cls = getattr(module, class_name, None)
    except Exception as exc:  # a module __getattr__ that fails
        raise ConfigError(f"{what} {import_path!r}: looking up {class_name!r} raised {_error_text(exc)}") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        article = "an" if base.__name__[:1] in "AEIOU" else "a"
        raise ConfigError(f"{import_path!r} does not name {article} {base.__name__} subclass")
    return cls
