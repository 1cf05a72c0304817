"""The self-describing value format shared by every secondary tier.

A stored value is a fixed 128-byte header followed by the payload. Two header
layouts exist; the writer picks format 1 for keys of up to 32 bytes (so values
stay readable by every kvtier release, and data written before format 2 keeps
being served) and format 2 for longer keys (up to :data:`MAX_KEY_BYTES`, e.g.
vLLM's 36-byte offload keys). Readers accept both.

Format 1 (keys of 1..32 bytes)::

    offset size field
    0      8    magic  b"KVTIER\x00\x01"
    8      4    format version (uint32 LE, 1)
    12     4    header length (uint32 LE, 128)
    16     16   namespace digest
    32     32   block key (zero padded)
    64     4    key length (uint32 LE)
    68     4    reserved (0)
    72     8    payload length (uint64 LE)
    80     8    payload checksum: xxh3_64 of the payload (uint64 LE)
    88     8    header checksum: xxh3_64 of bytes 0..88 (uint64 LE)
    96     32   reserved (0)

Format 2 (keys of 33..64 bytes)::

    0      8    magic  b"KVTIER\x00\x01"
    8      4    format version (uint32 LE, 2)
    12     4    header length (uint32 LE, 128)
    16     16   namespace digest
    32     64   block key (zero padded)
    96     4    key length (uint32 LE)
    100    4    reserved (0)
    104    8    payload length (uint64 LE)
    112    8    payload checksum: xxh3_64 of the payload (uint64 LE)
    120    8    header checksum: xxh3_64 of bytes 0..120 (uint64 LE)

Readers verify every field before a payload byte is trusted; any mismatch
raises :class:`~kvtier.errors.CorruptValueError`, and a value with the magic but a
format version this release does not know (a newer release's, sharing the tier)
raises its subclass :class:`~kvtier.errors.ForeignFormatError`: not served, and never
deleted, since its writer can read it. Nothing is ever unpickled or
evaluated. Backends that need the payload page aligned (O_DIRECT) place it at
an aligned offset themselves; the header describes the payload, not its position.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeGuard

import xxhash

from kvtier.errors import CorruptValueError, ForeignFormatError

MAGIC = b"KVTIER\x00\x01"
FORMAT_VERSION = 2
"""The newest value format (readers accept 1 and 2)."""
HEADER_SIZE = 128
MAX_KEY_BYTES = 64
"""The longest block key a value can carry (and the manager accepts)."""
_V1_KEY_BYTES = 32
_LAYOUT_V1 = struct.Struct("<8sII16s32sIIQQ")  # 88 bytes, then the header checksum
_LAYOUT_V2 = struct.Struct("<8sII16s64sIIQQ")  # 120 bytes, then the header checksum
_LAYOUTS = {1: _LAYOUT_V1, 2: _LAYOUT_V2}
READABLE_FORMATS = tuple(sorted(_LAYOUTS))
"""The value format versions this release reads."""
_PREFIX = struct.Struct("<8sII")
PREFIX_SIZE = _PREFIX.size
"""Bytes at the start of a value that say whose format it is (magic, version, header length)."""
_CHECK = struct.Struct("<Q")


_GIL_FREE_CHECKSUM_BYTES = 64 * 1024


def payload_checksum(payload: bytes | bytearray | memoryview) -> int:
    """xxh3_64 of a payload; runs at memory speed (tens of GB/s).

    Large payloads go through the streaming ``xxh3_64`` object, whose update
    releases the GIL (the one-shot function does not), so tier I/O threads hash
    blocks in parallel with each other and with the scheduler thread.
    """
    if len(memoryview(payload).cast("B")) >= _GIL_FREE_CHECKSUM_BYTES:
        return int(xxhash.xxh3_64(payload).intdigest())
    return int(xxhash.xxh3_64_intdigest(payload))


@dataclass(frozen=True)
class ValueHeader:
    namespace: bytes
    key: bytes
    payload_len: int
    checksum: int

    def pack(self) -> bytes:
        """The 128-byte header (format 1 for keys of up to 32 bytes, else format 2)."""
        if len(self.namespace) != 16:
            raise ValueError(f"namespace digest must be 16 bytes, got {len(self.namespace)}")
        if not 0 < len(self.key) <= MAX_KEY_BYTES:
            raise ValueError(f"block key must be 1 to {MAX_KEY_BYTES} bytes, got {len(self.key)}")
        v1 = len(self.key) <= _V1_KEY_BYTES
        layout = _LAYOUT_V1 if v1 else _LAYOUT_V2
        head = layout.pack(
            MAGIC,
            1 if v1 else 2,
            HEADER_SIZE,
            self.namespace,
            self.key.ljust(_V1_KEY_BYTES if v1 else MAX_KEY_BYTES, b"\x00"),
            len(self.key),
            0,
            self.payload_len,
            self.checksum,
        )
        check = _CHECK.pack(xxhash.xxh3_64_intdigest(head))
        return head + check + bytes(HEADER_SIZE - len(head) - len(check))


def encode_header(namespace: bytes, key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """Build the header for ``payload`` (computes the payload checksum)."""
    return ValueHeader(namespace, key, len(memoryview(payload).cast("B")), payload_checksum(payload)).pack()


def decode_header(
    raw: bytes | bytearray | memoryview,
    *,
    namespace: bytes,
    key: bytes,
    payload_len: int | None = None,
) -> ValueHeader:
    """Parse and verify a header against what the reader expects.

    Raises :class:`CorruptValueError` naming the first mismatch: short header,
    magic, version, header checksum, namespace, key or payload length;
    :class:`ForeignFormatError` for the magic with a version this release cannot read.
    """
    raw = bytes(raw[:HEADER_SIZE])
    if len(raw) < HEADER_SIZE:
        raise CorruptValueError(f"value header truncated: {len(raw)} of {HEADER_SIZE} bytes")
    magic, version, hlen = _PREFIX.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptValueError(f"bad magic {magic!r}")
    layout = _LAYOUTS.get(version)
    if layout is None:
        raise ForeignFormatError(f"unsupported value format version {version} (header {hlen} bytes): another release's")
    if hlen != HEADER_SIZE:
        raise CorruptValueError(f"value format version {version} with a header of {hlen} bytes, not {HEADER_SIZE}")
    (stored_check,) = _CHECK.unpack_from(raw, layout.size)
    if stored_check != xxhash.xxh3_64_intdigest(raw[: layout.size]):
        raise CorruptValueError("header checksum mismatch")
    _, _, _, ns, padded_key, key_len, _, plen, checksum = layout.unpack_from(raw)
    if ns != namespace:
        raise CorruptValueError(f"namespace mismatch: value has {ns.hex()}, expected {namespace.hex()}")
    if key_len > len(padded_key) or padded_key[:key_len] != key:
        raise CorruptValueError(f"key mismatch: value is for {padded_key[:key_len].hex()}, expected {key.hex()}")
    if payload_len is not None and plen != payload_len:
        raise CorruptValueError(f"payload length mismatch: header says {plen}, expected {payload_len}")
    return ValueHeader(ns, padded_key[:key_len], plen, checksum)


def foreign_format(prefix: bytes | bytearray | memoryview) -> int | None:
    """The format version of a value whose first bytes are ``prefix`` when it carries the magic
    with a version this release cannot read (another release's value: see
    :class:`ForeignFormatError`); None otherwise (ours, or not a value at all)."""
    if len(prefix) < PREFIX_SIZE:
        return None
    magic, version, _ = _PREFIX.unpack_from(bytes(prefix[:PREFIX_SIZE]))
    return version if magic == MAGIC and version not in _LAYOUTS else None


def older_readable_format(version: object) -> TypeGuard[int]:
    """Whether a namespace manifest's ``value_format_version`` names an older format this release
    reads (an integer: JSON's ``true`` is not 1), which the fs and S3 tiers take and rewrite to
    :data:`FORMAT_VERSION`, and ``kvtier inspect`` accepts."""
    return type(version) is int and version != FORMAT_VERSION and version in READABLE_FORMATS


def payload_hasher() -> xxhash.xxh3_64:
    """An incremental payload checksum: ``update()`` it chunk by chunk as a payload arrives
    (large updates release the GIL), then check it with :func:`verify_digest`."""
    return xxhash.xxh3_64()


def verify_digest(header: ValueHeader, payload_len: int, digest: int) -> None:
    """Raise :class:`CorruptValueError` unless a payload of ``payload_len`` bytes hashing to
    ``digest`` (from :func:`payload_hasher`) is the one ``header`` describes."""
    if payload_len != header.payload_len:
        raise CorruptValueError(f"payload truncated: {payload_len} of {header.payload_len} bytes")
    if digest != header.checksum:
        raise CorruptValueError("payload checksum mismatch")


def verify_payload(header: ValueHeader, payload: bytes | bytearray | memoryview) -> None:
    """Raise :class:`CorruptValueError` unless ``payload`` matches the header's length and checksum."""
    n = len(memoryview(payload).cast("B"))
    if n != header.payload_len:
        raise CorruptValueError(f"payload truncated: {n} of {header.payload_len} bytes")
    if payload_checksum(payload) != header.checksum:
        raise CorruptValueError("payload checksum mismatch")
