"""The shared value format: every mismatch is detected, nothing is trusted unverified."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.errors import CorruptValueError
from kvtier.tiers.format import (
    HEADER_SIZE,
    decode_header,
    encode_header,
    payload_checksum,
    payload_hasher,
    verify_digest,
    verify_payload,
)

NS = bytes(range(16))
KEY = b"k" * 32
PAYLOAD = bytes(range(256)) * 40


def test_round_trip() -> None:
    raw = encode_header(NS, KEY, PAYLOAD)
    assert len(raw) == HEADER_SIZE
    header = decode_header(raw, namespace=NS, key=KEY, payload_len=len(PAYLOAD))
    verify_payload(header, PAYLOAD)
    assert header.payload_len == len(PAYLOAD)


@pytest.mark.parametrize("offset", [0, 9, 20, 40, 70, 75, 85, 90])
def test_any_flipped_header_byte_is_detected(offset: int) -> None:
    raw = bytearray(encode_header(NS, KEY, PAYLOAD))
    raw[offset] ^= 0x40
    with pytest.raises(CorruptValueError):
        decode_header(raw, namespace=NS, key=KEY, payload_len=len(PAYLOAD))


def test_mismatches_are_named() -> None:
    raw = encode_header(NS, KEY, PAYLOAD)
    with pytest.raises(CorruptValueError, match="namespace"):
        decode_header(raw, namespace=bytes(16), key=KEY)
    with pytest.raises(CorruptValueError, match="key mismatch"):
        decode_header(raw, namespace=NS, key=b"o" * 32)
    with pytest.raises(CorruptValueError, match="length"):
        decode_header(raw, namespace=NS, key=KEY, payload_len=1)
    with pytest.raises(CorruptValueError, match="truncated"):
        decode_header(raw[:50], namespace=NS, key=KEY)
    with pytest.raises(CorruptValueError, match="magic"):
        decode_header(b"\x00" * HEADER_SIZE, namespace=NS, key=KEY)


def test_payload_corruption_and_truncation() -> None:
    header = decode_header(encode_header(NS, KEY, PAYLOAD), namespace=NS, key=KEY)
    bad = bytearray(PAYLOAD)
    bad[5000] ^= 1
    with pytest.raises(CorruptValueError, match="checksum"):
        verify_payload(header, bad)
    with pytest.raises(CorruptValueError, match="truncated"):
        verify_payload(header, PAYLOAD[:-1])


def test_checksum_is_xxh3_64_for_small_and_large_payloads() -> None:
    import xxhash

    from kvtier.tiers.format import payload_checksum

    for size in (0, 100, 64 * 1024 - 1, 64 * 1024, 3 * 1024 * 1024 + 5):
        data = bytes(range(256)) * (size // 256) + bytes(size % 256)
        assert payload_checksum(data) == xxhash.xxh3_64_intdigest(data), size
        assert payload_checksum(memoryview(data)) == payload_checksum(bytearray(data))


def test_incremental_digest_matches_and_is_verified() -> None:
    payload = np.random.default_rng(5).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    header = decode_header(encode_header(NS, KEY, payload), namespace=NS, key=KEY)
    hasher = payload_hasher()
    for start in range(0, len(payload), 70_000):  # uneven chunks, as a network body arrives
        hasher.update(payload[start : start + 70_000])
    assert hasher.intdigest() == payload_checksum(payload)
    verify_digest(header, len(payload), hasher.intdigest())
    with pytest.raises(CorruptValueError, match="checksum"):
        verify_digest(header, len(payload), hasher.intdigest() ^ 1)
    with pytest.raises(CorruptValueError, match="truncated"):
        verify_digest(header, len(payload) - 1, hasher.intdigest())


@pytest.mark.parametrize("length", [1, 8, 32, 33, 36, 64])
def test_keys_of_every_length_up_to_the_maximum_round_trip(length: int) -> None:
    """vLLM's 36-byte offload keys (and anything up to MAX_KEY_BYTES) are stored as they are."""
    from kvtier.tiers.format import MAX_KEY_BYTES

    assert MAX_KEY_BYTES >= 64
    key = bytes(range(1, length + 1))
    raw = encode_header(NS, key, PAYLOAD)
    assert len(raw) == HEADER_SIZE
    version = int.from_bytes(raw[8:12], "little")
    assert version == (1 if length <= 32 else 2), "keys of up to 32 bytes keep format 1 (readable by old releases)"
    header = decode_header(raw, namespace=NS, key=key, payload_len=len(PAYLOAD))
    assert header.key == key
    with pytest.raises(CorruptValueError, match="key mismatch"):
        decode_header(raw, namespace=NS, key=key[:-1] + b"\xff")
    with pytest.raises(CorruptValueError, match="key mismatch"):
        decode_header(raw, namespace=NS, key=key + b"\x00")


@pytest.mark.parametrize("offset", [0, 9, 20, 40, 90, 97, 105, 115, 125])
def test_any_flipped_byte_of_a_format_2_header_is_detected(offset: int) -> None:
    key = b"v" * 36
    raw = bytearray(encode_header(NS, key, PAYLOAD))
    raw[offset] ^= 0x40
    with pytest.raises(CorruptValueError):
        decode_header(raw, namespace=NS, key=key, payload_len=len(PAYLOAD))


def test_keys_beyond_the_maximum_or_empty_are_refused() -> None:
    from kvtier.tiers.format import MAX_KEY_BYTES

    for key in (b"", b"x" * (MAX_KEY_BYTES + 1)):
        with pytest.raises(ValueError, match="block key"):
            encode_header(NS, key, PAYLOAD)


def test_unknown_format_version_is_refused_clearly() -> None:
    import struct

    import xxhash

    raw = bytearray(encode_header(NS, KEY, PAYLOAD))
    struct.pack_into("<I", raw, 8, 3)
    struct.pack_into("<Q", raw, 88, xxhash.xxh3_64_intdigest(bytes(raw[:88])))
    with pytest.raises(CorruptValueError, match="unsupported value format version 3"):
        decode_header(raw, namespace=NS, key=KEY)


def test_another_releases_format_version_is_foreign_not_corrupt() -> None:
    """Regression: a value in a format version this release cannot read (a newer release sharing
    the medium) was reported as corrupt, and tiers deleted it."""
    from kvtier.errors import ForeignFormatError
    from kvtier.tiers.format import foreign_format

    header = bytearray(encode_header(NS, KEY, b"x" * 64))
    assert foreign_format(header) is None  # ours
    header[8:12] = (3).to_bytes(4, "little")
    assert foreign_format(header) == 3
    with pytest.raises(ForeignFormatError, match="unsupported value format version 3"):
        decode_header(header, namespace=NS, key=KEY, payload_len=64)
    assert foreign_format(b"not a value at all, no magic") is None
    assert foreign_format(header[:10]) is None  # too short to tell
    # A known version with a header length of another size is corrupt, not foreign.
    known = bytearray(encode_header(NS, KEY, b"x" * 64))
    known[12:16] = (256).to_bytes(4, "little")
    with pytest.raises(CorruptValueError) as caught:
        decode_header(known, namespace=NS, key=KEY, payload_len=64)
    assert not isinstance(caught.value, ForeignFormatError)
