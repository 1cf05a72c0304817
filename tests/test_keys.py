"""Block keys and namespaces: stable, chained, collision-conscious."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.keys import KVGeometry, Namespace, chain_ids, chain_key, prefix_keys, root_key, session_digest

GEOM = KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype="bfloat16")
NS = Namespace("meta-llama/Llama-3.1-8B", GEOM)


def test_bytes_per_block() -> None:
    assert GEOM.bytes_per_block == 2 * 32 * 8 * 128 * 2 * 16 == 2 * 1024 * 1024
    mla = KVGeometry(num_layers=61, num_kv_heads=1, head_dim=576, tokens_per_block=64, dtype="fp8", kv_factor=1)
    assert mla.bytes_per_block == 61 * 576 * 64
    assert KVGeometry.from_block_bytes(8192).bytes_per_block == 8192


def test_keys_are_chained_and_cover_the_whole_prefix() -> None:
    tokens = np.arange(64)
    a = prefix_keys(tokens, 16)
    assert len(a) == 4 and len(set(a)) == 4 and all(len(k) == 32 for k in a)
    changed = tokens.copy()
    changed[3] = 999
    b = prefix_keys(changed, 16)
    assert all(x != y for x, y in zip(a, b, strict=True)), "a change in block 0 changes every later key"
    changed = tokens.copy()
    changed[40] = 999
    c = prefix_keys(changed, 16)
    assert c[:2] == a[:2] and c[2] != a[2] and c[3] != a[3]


def test_partial_tail_is_not_keyed() -> None:
    assert len(prefix_keys(np.arange(47), 16)) == 2


def test_extra_and_namespace_change_keys() -> None:
    tokens = np.arange(32)
    base = prefix_keys(tokens, 16)
    assert prefix_keys(tokens, 16, extra=b"lora-7") != base
    assert prefix_keys(tokens, 16, namespace=NS) != base
    assert prefix_keys(tokens, 16, algorithm="blake2b") != base


def test_golden_value_never_changes() -> None:
    # If this fails, the key derivation changed: every persisted tier would silently miss.
    assert prefix_keys([1, 2, 3, 4], 4)[0].hex() == "ecfe1a15c773e2a3b17561fb5cbaab78ce995f319f5c9f5a2f78d91ac93f4568"


def test_derivation_matches_the_documented_spec() -> None:
    import hashlib
    import struct

    root = hashlib.sha256(b"kvtier/chain/v1").digest()
    tokens = struct.pack("<4I", 1, 2, 3, 4)
    expected = hashlib.sha256(root + len(tokens).to_bytes(4, "little") + tokens).digest()
    assert chain_key(root_key(), [1, 2, 3, 4]) == expected == prefix_keys([1, 2, 3, 4], 4)[0]


def test_stable_across_processes_regardless_of_hash_seed() -> None:
    code = "from kvtier.keys import prefix_keys; print(prefix_keys(list(range(32)), 16)[1].hex())"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        ).stdout.strip()
        for seed in ("0", "1", "12345")
    }
    assert outs == {prefix_keys(list(range(32)), 16)[1].hex()}


def test_chain_ids_match_shape_of_prefix_keys() -> None:
    a = chain_ids([5, 6, 7])
    b = chain_ids([5, 6, 8])
    assert a[:2] == b[:2] and a[2] != b[2]
    assert chain_ids([9, 6, 7])[1] != a[1]


def test_token_ids_out_of_range_are_rejected() -> None:
    with pytest.raises(ConfigError, match="token ids"):
        prefix_keys([-1] * 16, 16)
    with pytest.raises(ConfigError, match="tokens_per_block"):
        prefix_keys([1] * 16, 0)


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"model_revision": "abc123"},
        {"geometry": dataclasses.replace(GEOM, dtype="float16")},
        {"geometry": dataclasses.replace(GEOM, tokens_per_block=32)},
        {"geometry": dataclasses.replace(GEOM, num_layers=16)},
        {"geometry": dataclasses.replace(GEOM, num_kv_heads=4)},
        {"geometry": dataclasses.replace(GEOM, head_dim=64)},
        {"tp_size": 2},
        {"pp_size": 2},
        {"format_version": 99},
        {"extra": (("kv_cache_dtype_scale", "per-tensor"),)},
    ],
)
def test_namespace_digest_covers_every_incompatibility(change: dict[str, object]) -> None:
    assert dataclasses.replace(NS, **change).digest != NS.digest  # type: ignore[arg-type]


def test_namespace_digest_is_stable_and_canonical() -> None:
    same = Namespace("meta-llama/Llama-3.1-8B", dataclasses.replace(GEOM, dtype="torch.bfloat16"))
    assert same.digest == NS.digest
    assert len(NS.digest) == 16 and NS.hexdigest == NS.digest.hex()


def test_geometry_and_namespace_validation() -> None:
    with pytest.raises(ConfigError, match="num_layers"):
        KVGeometry(num_layers=0, num_kv_heads=1, head_dim=1, tokens_per_block=1)
    with pytest.raises(ConfigError, match="unknown KV dtype"):
        KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_block=1, dtype="float128")
    with pytest.raises(ConfigError, match="kv_factor"):
        KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_block=1, kv_factor=3)
    with pytest.raises(ConfigError, match="model_id"):
        Namespace("", GEOM)
    with pytest.raises(ConfigError, match="tp_rank"):
        Namespace("m", GEOM, tp_size=2, tp_rank=2)


def test_a_session_id_has_one_stable_64_bit_digest() -> None:
    """The policy's session clock and learned admission remember a conversation by this digest
    (one function for both): the same in every process (no per-process seed), defined for any
    string a client may send, lone surrogates included."""
    assert session_digest("conversation-1") == 10783618265777226936
    assert session_digest("a\udc80b") == 15855175708145225553
    digests = {session_digest(f"s{i}") for i in range(1000)}
    assert len(digests) == 1000 and all(0 <= d < 2**64 for d in digests)


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        ([1.5] * 16, "got a float"),
        (np.ones(16), "got values of type float64"),
        ([True] * 16, "got values of type bool"),
        (["a"] * 16, "got values of type <U1"),
        ([None] * 16, "got a NoneType"),
        ([[1] * 16], "got an array of shape (1, 16)"),
        ([1, [2]], "flat sequence of integers"),
        ([2**70] * 16, "outside that range"),
    ],
)
def test_token_ids_that_are_not_integers_are_refused(tokens: list[object], fragment: str) -> None:
    """Regression (docs audit, 2026-12-05): a float id was cut to an integer (``[1.5] * 16`` got the
    keys of ``[1] * 16``: another prompt's keys), a string gave numpy's UFuncTypeError, None a bare
    TypeError."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        prefix_keys(tokens, 16)  # type: ignore[arg-type]


def test_token_ids_of_mixed_integer_kinds_are_integers() -> None:
    """Review (2026-12-05): numpy makes a list of np.uint64 and Python ints float64; every id is an
    integer still, and gets the keys of the same ids as plain ints."""
    assert prefix_keys([np.uint64(1), 2] * 8, 16) == prefix_keys([1, 2] * 8, 16)
    assert prefix_keys([np.uint64(7), np.int64(2)] * 8, 16) == prefix_keys([7, 2] * 8, 16)


@pytest.mark.parametrize("geometry", [{"num_layers": 2}, (2, 2, 64, 16), "llama"])
def test_a_namespace_with_a_geometry_that_is_no_kvgeometry_is_refused(geometry: object) -> None:
    """Regression (2026-12-06, review): ``Namespace("m", {"num_layers": 2})`` was accepted, and the
    manager then failed with "AttributeError: 'dict' object has no attribute 'bytes_per_block'"."""
    refused = f"Namespace.geometry must be a kvtier.KVGeometry, got a {type(geometry).__name__}"
    with pytest.raises(ConfigError, match=refused):
        Namespace("m", geometry)  # type: ignore[arg-type]
