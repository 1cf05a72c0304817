"""vLLM's prefix-cache block hashes computed from token ids, as its KV events carry them.

vLLM (0.32) hashes a prompt in blocks of ``tokens_per_hash`` tokens (the KV-cache
block size), each chained on its parent: ``h_i = H((h_{i-1}, tuple(tokens_i), None))``
with ``h_{-1} = NONE_HASH = H(seed)``. ``H`` is the engine's
``--prefix-caching-hash-algo``: ``sha256`` (of the pickled tuple; the default),
``sha256_cbor`` (of its canonical CBOR), ``xxhash`` / ``xxhash_cbor`` (XXH3-128).
The seed is ``PYTHONHASHSEED`` when the engine has it set; otherwise
``"vllm-none-hash"`` for the sha256 algorithms and a random per-process value for the
xxhash ones (which then never match across processes: set PYTHONHASHSEED). Events
carry the lower 64 bits of each hash as an integer (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
on by default) or the bytes; :func:`event_hash` maps either to that integer.

Only plain token prompts: LoRA adapters, multimodal inputs, ``cache_salt`` and prompt
embeddings add extra keys to a block's hash that a token list does not carry; a router
that uses them computes the block hashes itself and asks by hash.

The pickle used for ``sha256`` and ``xxhash`` only *writes* a tuple of bytes and ints
(the engine's own input to its hash); nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.errors import ConfigError

DEFAULT_SEED = "vllm-none-hash"
"""vLLM's NONE_HASH seed for sha256 and sha256_cbor when PYTHONHASHSEED is not set."""

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_MASK64 = (1 << 64) - 1


def _pickled(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(value: Any) -> bytes:
    try:
        import cbor2
    except ImportError as exc:  # pragma: no cover - cbor2 comes with vLLM
        raise ConfigError("the *_cbor hash algorithms need the cbor2 package: pip install cbor2") from exc
    return bytes(cbor2.dumps(value, canonical=True))


def _xxh3_128(data: bytes) -> bytes:
    import xxhash

    return bytes(xxhash.xxh3_128_digest(data))


_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda value: hashlib.sha256(_pickled(value)).digest(),
    "sha256_cbor": lambda value: hashlib.sha256(_cbor(value)).digest(),
    "xxhash": lambda value: _xxh3_128(_pickled(value)),
    "xxhash_cbor": lambda value: _xxh3_128(_cbor(value)),
}


def event_hash(raw: int | bytes) -> int:
    """The integer a KV event carries for a block hash (its lower 64 bits)."""
    if isinstance(raw, bytes | bytearray):
        return int.from_bytes(raw, "big") & _MASK64
    return int(raw) & _MASK64


class BlockHasher:
    """Block hashes of token lists the way a vLLM engine configured alike computes them.

    ``algorithm``: one of :data:`ALGORITHMS`; ``seed``: the engines' PYTHONHASHSEED, or
    None for vLLM's default seed (sha256 algorithms only); ``tokens_per_hash``: the
    engines' KV-cache block size.
    """

    def __init__(self, algorithm: str = "sha256", seed: str | None = None, tokens_per_hash: int = 16) -> None:
        if algorithm not in _FUNCTIONS:
            raise ConfigError(f"hash algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
        if seed is None and algorithm.startswith("xxhash"):
            raise ConfigError(
                f"hash algorithm {algorithm!r} needs the engines' PYTHONHASHSEED as the seed (without it every "
                "vLLM process draws a random one and no two engines share blocks)"
            )
        if isinstance(tokens_per_hash, bool) or not isinstance(tokens_per_hash, int) or tokens_per_hash < 1:
            raise ConfigError(f"tokens_per_hash must be an integer >= 1, got {tokens_per_hash!r}")
        self.algorithm = algorithm
        self.tokens_per_hash = tokens_per_hash
        self._hash = _FUNCTIONS[algorithm]
        self._none_hash = self._hash(DEFAULT_SEED if seed is None else seed)

    def block_hashes(self, tokens: Sequence[int], limit: int | None = None) -> list[bytes]:
        """The hash of each full block of ``tokens`` (at most ``limit`` blocks), in order."""
        size = self.tokens_per_hash
        blocks = len(tokens) // size
        if limit is not None:
            blocks = min(blocks, limit)
        parent = self._none_hash
        out: list[bytes] = []
        for i in range(blocks):
            parent = self._hash((parent, tuple(tokens[i * size : (i + 1) * size]), None))
            out.append(parent)
        return out

    def event_hashes(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """:meth:`block_hashes` as the integers KV events carry."""
        return [event_hash(h) for h in self.block_hashes(tokens, limit)]
