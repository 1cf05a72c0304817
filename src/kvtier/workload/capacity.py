"""``kvtier replay --capacity``: CPU tier sizes as block counts, shares of a trace, or byte sizes.

Three forms, comma separated, each read exactly:

* a plain integer (``9139``): that many CPU blocks, i.e. trace blocks (``hash_ids``);
* a share (``5%``): that share of the trace's distinct blocks, rounded to a block;
* a size with a unit (``4GiB``, ``512MB``, ``4G`` as everywhere in kvtier: binary
  without ``B``): the blocks of that many bytes, whole blocks only
  (``size // block_bytes``), where ``block_bytes`` is the KV size of one trace block
  for the model given (bytes per token of its geometry x tokens per trace block).

Parsing names the flag and the value as typed (:class:`~kvtier.errors.ConfigError`).
Pure functions; any thread.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.units import comma_entries, format_size, parse_size, shown

FLAG = "--capacity"
MAX_DIGITS = 30
_UNIT = re.compile(r"[a-zA-Z]\s*$")


@dataclass(frozen=True)
class Capacity:
    """One ``--capacity`` entry as typed: exactly one of ``blocks``, ``share`` (in (0, 1]) or ``nbytes``."""

    text: str
    blocks: int | None = None
    share: float | None = None
    nbytes: int | None = None


def parse_capacities(text: str, max_blocks: int, flag: str = FLAG, sizes: bool = True) -> list[Capacity]:
    """The entries of ``--capacity TEXT`` (or of the flag ``flag`` that reads the same forms); a
    block count above ``max_blocks`` is refused here. ``sizes``: the flag takes sizes too (its
    messages suggest them; the caller refuses one)."""
    out = [_parse_one(part, max_blocks, flag, sizes) for part in comma_entries(text, flag)]
    if not out:
        raise ConfigError(
            f"{flag} {shown(text)}: give block counts, shares of the distinct blocks or sizes, "
            "e.g. 1000,9139 or 1%,5% or 4GiB,16GiB" if sizes else
            f"{flag} {shown(text)}: give a block count or a share of the distinct blocks, e.g. 20000 or 10%"
        )
    return out


_PERCENT = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")
"""A plain decimal number, the only spelling of a share's percentage."""


def _parse_one(part: str, max_blocks: int, flag: str, sizes: bool) -> Capacity:
    if part.endswith("%"):
        if not _PERCENT.fullmatch(part[:-1]):  # float() also reads "1_0", "1e2", "nan", "²"
            raise ConfigError(f"{flag} {shown(part)}: not a percentage like 5% or 0.5%")
        share = float(part[:-1]) / 100
        if not 0 < share <= 1:  # also refuses nan
            raise ConfigError(f"{flag} {shown(part)}: a share must lie in (0%, 100%]")
        return Capacity(part, share=share)
    if part.isascii() and part.isdigit():  # int() also reads "²" and fullwidth digits
        if len(part) > MAX_DIGITS or int(part) > max_blocks:
            raise ConfigError(f"{flag} {shown(part)}: at most {max_blocks} blocks; give fewer"
                              f"{', a share like 5% or a size like 4GiB' if sizes else ' or a share like 5%'}")
        if int(part) == 0:
            raise ConfigError(f"{flag} {shown(part)}: give positive block counts (0 blocks holds nothing)"
                              f"{', shares like 5% or sizes like 4GiB' if sizes else ' or shares like 5%'}")
        return Capacity(part, blocks=int(part))
    if _UNIT.search(part):
        try:
            nbytes = parse_size(part)
        except ConfigError as exc:
            if not sizes:  # not a size either: say what the flag takes
                raise ConfigError(f"{flag} {shown(part)}: not a block count (e.g. 9139) or a share (e.g. 5%)") from None
            raise ConfigError(f"{flag} {shown(part)}: {exc}") from None
        if nbytes == 0:
            raise ConfigError(f"{flag} {shown(part)}: a size must be positive")
        return Capacity(part, nbytes=nbytes)
    raise ConfigError(
        f"{flag} {shown(part)}: not a block count (e.g. 9139), a share (e.g. 5%)"
        f"{' or a size with a unit (e.g. 4GiB)' if sizes else ''}"
    )


def capacity_blocks(
    entries: Sequence[Capacity], distinct_blocks: int, block_bytes: int | None, max_blocks: int, block_note: str = "",
    flag: str = FLAG,
) -> list[int]:
    """The CPU capacities in blocks, in the order given, duplicates dropped.

    ``block_bytes``: KV bytes of one trace block (needed only by sizes; None: no model
    was given, and a size is refused saying how to give one). ``block_note`` says where
    the block size came from, for messages. Raises :class:`ConfigError` for an entry
    that comes to less than one block.
    """
    out: list[int] = []
    for entry in entries:
        if entry.blocks is not None:
            blocks = entry.blocks
        elif entry.share is not None:
            blocks = round(entry.share * distinct_blocks)
            if blocks < 1:
                raise ConfigError(
                    f"{flag} {shown(entry.text)} of the {distinct_blocks} distinct blocks is less than one block: "
                    "give a larger share or a block count"
                )
        else:
            assert entry.nbytes is not None
            if block_bytes is None:
                raise ConfigError(
                    f"{flag} {shown(entry.text)} is a size: give the model whose KV fills it (--model PRESET, or "
                    "--block-bytes SIZE for one trace block of another model) so it converts to blocks, or give a "
                    "block count"
                )
            blocks = entry.nbytes // block_bytes
            if blocks < 1:
                raise ConfigError(
                    f"{flag} {shown(entry.text)} holds less than one block of {format_size(block_bytes)}"
                    f"{block_note}: give a larger size"
                )
            if blocks > max_blocks:
                raise ConfigError(
                    f"{flag} {shown(entry.text)} is {blocks} blocks of {format_size(block_bytes)}{block_note}: "
                    f"at most {max_blocks} blocks; give a smaller size"
                )
        if blocks not in out:
            out.append(blocks)
    return out


def largest_known_blocks(entries: Sequence[Capacity]) -> int | None:
    """The largest block count given as a count (checked against memory before a trace is read)."""
    counts = [e.blocks for e in entries if e.blocks is not None]
    return max(counts) if counts else None
