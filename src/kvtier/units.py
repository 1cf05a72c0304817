"""Sizes: parsing ``"4GiB"``, formatting bytes, page rounding, rows that fit in a budget.

One implementation of each, used by the configuration, the shared region, the
manager and the command line. Pure functions; any thread.
"""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from kvtier.errors import ConfigError, int_text

PAGE_SIZE = mmap.PAGESIZE
"""The machine's page size: every CPU-tier row starts on a page boundary."""

_SIZE_RE = re.compile(r"^\s*([0-9]+)(?:\.([0-9]+))?\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
    "p": 1024**5,
    "pib": 1024**5,
    "pb": 1000**5,
    "e": 1024**6,
    "eib": 1024**6,
    "eb": 1000**6,
}

MAX_SIZE = 2**63 - 1
"""The largest size kvtier accepts (8 EiB, the largest file offset): anything above is refused."""

_MAX_SIZE_DIGITS = 40
"""Digits read from a size string at most; a longer number is refused before it is converted."""

_FORMS = (
    "use bytes (e.g. 4294967296) or a number with a unit such as '512MiB', '4GiB', '4G' (binary) or '4GB' (decimal)"
)


HOLDS_URL = "it holds an '@' or a '://', maybe a URL with credentials"
"""Why a text is not shown in a message (an '@' or a '://' may be a URL's password)."""

_NOT_SHOWN = f"not shown: {HOLDS_URL}"


def shown(text: str, limit: int = 40) -> str:
    """``repr(text)``, shortened to about ``limit`` characters with its length said, for messages.

    Text with an '@' or a '://' (maybe a URL with a password) is not shown at all, only its length.
    """
    if "@" in text or "://" in text:
        return f"(a text of {len(text)} characters, {_NOT_SHOWN})"
    if len(text) <= limit:
        return repr(text)
    return f"{text[: limit // 2]!r}... ({len(text)} characters)"


def _too_large(shown_value: str) -> ConfigError:
    return ConfigError(
        f"size {shown_value} is above the largest size kvtier accepts, 8 EiB less one byte ({MAX_SIZE} bytes)"
    )


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a size string, exactly.

    ``"4GiB"``, ``"4G"`` and ``"4 gib"`` are 4 * 2**30; ``"4GB"`` is 4 * 10**9;
    ``"512MiB"``, ``"1.5GiB"`` and ``"4096"`` work too. The arithmetic is on
    integers (no float rounding, however large the number); a fraction of a byte
    (``"1.3GiB"`` is 1395864371.2 bytes) is dropped. Raises :class:`ConfigError`
    (naming the value and the accepted forms) for anything else, a negative or
    non-finite size, or one above :data:`MAX_SIZE`; a number of more than 40
    digits is refused before it is converted.
    """
    if isinstance(value, bool):
        raise ConfigError(f"size {value!r} is a boolean: give bytes as an integer or a string like '4GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size {int_text(value)} is negative: give a positive number of bytes")
        if value > MAX_SIZE:
            raise _too_large(int_text(value))
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"size {value} is not a finite number: give bytes, e.g. 4294967296 or '4GiB'")
        if value < 0 or not value.is_integer():
            raise ConfigError(f"size {value} must be a whole, non-negative number of bytes")
        return parse_size(int(value))
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            whole, fraction, unit = m.group(1), m.group(2) or "", m.group(3).lower()
            if len(whole) + len(fraction) > _MAX_SIZE_DIGITS:
                raise _too_large(shown(value.strip()))
            if unit in _SIZE_UNITS:
                scale = 10 ** len(fraction)
                size: int = (int(whole + fraction) * _SIZE_UNITS[unit]) // scale
                if size > MAX_SIZE:
                    raise _too_large(shown(value.strip()))
                return size
        raise ConfigError(f"size {shown(value)} is not understood: {_FORMS}")
    raise ConfigError(f"size {_described(value)} has type {type(value).__name__}: use an int or a string like '4GiB'")


_SIZED = (str, bytes, bytearray, Mapping, AbstractSet, list, tuple)


def type_and_size(value: object) -> str:
    """A value for a message that must not show it: its type and length only (``a list of 3
    items``, ``a str of 80 characters``), never its contents (which may be a YAML alias bomb,
    however large or deep, or hold a password), in constant time."""
    try:
        count = len(value) if isinstance(value, _SIZED) else None
    except Exception:  # a subclass whose __len__ fails
        count = None
    unit = "characters" if isinstance(value, str) else "bytes" if isinstance(value, bytes | bytearray) else "items"
    return f"a {type(value).__name__}" + (f" of {count} {unit}" if count is not None else "")


def _described(value: object) -> str:
    """A value that is not a size, for a message: :func:`type_and_size`, said not shown."""
    return f"({type_and_size(value)}, not shown)"


def format_size(num_bytes: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units up to EiB, at most one decimal; any int (no overflow)."""
    if isinstance(num_bytes, int) and abs(num_bytes) >= 1024**7:
        sign = "" if num_bytes > 0 else "-"
        return f"{sign}about 2^{abs(num_bytes).bit_length() - 1} B"
    n = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"


def round_up(n: int, to: int = PAGE_SIZE) -> int:
    """``n`` rounded up to a multiple of ``to`` (default: the page size)."""
    return -(-n // to) * to


def row_stride_for(block_bytes: int) -> int:
    """Bytes one CPU row takes in the shared region: the block rounded up to a page."""
    return round_up(block_bytes)


def rows_that_fit(cpu_bytes: int, block_bytes: int) -> int:
    """CPU-tier rows of ``block_bytes`` (page-aligned) that ``cpu_bytes`` holds.

    Raises :class:`ConfigError` naming the smallest useful size when not even one fits.
    """
    stride = row_stride_for(block_bytes)
    rows = cpu_bytes // stride
    if rows < 1:
        fix = f"raise cpu_bytes to at least {stride}" if stride < 2**63 else "no size can hold one: check the geometry"
        raise ConfigError(f"cpu_bytes={cpu_bytes} holds no block of {stride} bytes (one page-aligned row): {fix}")
    return rows


def comma_entries(text: str, flag: str) -> list[str]:
    """The entries of a comma-separated flag value (``--capacity 1%,5%``, ``--policy lru,arc``),
    stripped; none for a text of commas and spaces only (the caller says what to give). An empty
    entry beside others (``10,,20``, a trailing comma) raises :class:`ConfigError` naming ``flag``
    and the text: a typo (10,,20 for 10,15,20) must not run fewer entries than asked."""
    parts = [part.strip() for part in text.split(",")]
    if any(parts) and not all(parts):
        raise ConfigError(f"{flag} {shown(text)}: an empty entry (two commas in a row, or one at an end); "
                          "give every entry or drop its comma")  # fmt: skip
    return [part for part in parts if part]


__all__ = [
    "MAX_SIZE", "PAGE_SIZE", "comma_entries", "format_size", "parse_size", "round_up", "row_stride_for",
    "rows_that_fit", "shown",
]  # fmt: skip
