"""Block keys: chained prefix hashing of token-id blocks, and namespaces.

A block key names the whole prefix that ends at that block:
``k_i = H(k_{i-1} || tokens of block i || extra)``. The default hash is SHA-256
(a collision would hand one request another request's KV, so it must be
cryptographic) and is stable across processes, restarts and machines: no
per-process seed is involved anywhere.

A :class:`Namespace` digests everything that makes KV bytes incompatible. Tiers
store data under the namespace digest, so two engines share blocks exactly when
their namespaces are equal.

All functions here are pure and thread-safe.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import xxhash

from kvtier.errors import ConfigError

BlockKey = bytes
"""A fixed-length block key (32 bytes for SHA-256)."""

KEY_FORMAT_VERSION = 1
"""Bumped whenever the key derivation or the stored value layout changes."""

_ROOT_SEED = b"kvtier/chain/v1"

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}

_HASHES = ("sha256", "blake2b")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV dtype name such as ``"bfloat16"``."""
    name = dtype.removeprefix("torch.").lower()
    try:
        return _DTYPE_BYTES[name]
    except KeyError:
        raise ConfigError(
            f"unknown KV dtype {dtype!r}: use one of {sorted(_DTYPE_BYTES)}"
        ) from None


def _new_hasher(algorithm: str) -> Any:
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=32)
    raise ConfigError(f"unknown key hash {algorithm!r}: use one of {list(_HASHES)}")


def token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``token_ids`` as a one-dimensional integer array, checked: a :class:`ConfigError` for ids
    outside ``[0, 2**32)`` and for anything that is not a flat sequence of integers (a float id:
    1.5 would be cut to 1, giving another prompt's keys; a bool, a string, None, a nesting)."""
    try:
        arr = np.asarray(token_ids)
    except (ValueError, TypeError) as exc:  # a ragged nesting, an object numpy cannot take
        raise ConfigError(f"token ids must be a flat sequence of integers ({exc})") from None
    if arr.ndim != 1:
        raise ConfigError(f"token ids must be a flat sequence of integers; got an array of shape {arr.shape}")
    if not arr.size:
        return arr.astype("<u4")
    if arr.dtype.kind not in "iu":
        if isinstance(token_ids, np.ndarray) or arr.dtype.kind not in "fO":
            raise ConfigError(f"token ids must be integers in [0, 2**32); got values of type {arr.dtype}")
        # A sequence numpy made floats or objects of: ints too large for int64, or ints of mixed
        # kinds ([np.uint64(1), 2] is float64), are integers still; a float, None... is not.
        arr = np.array([_token_id(t) for t in token_ids], dtype=object)
        if arr.min() < 0 or arr.max() >= 2**32:
            raise ConfigError("token ids must lie in [0, 2**32); got an id outside that range")
        return arr.astype(np.int64)
    if arr.min() < 0 or arr.max() >= 2**32:
        raise ConfigError("token ids must lie in [0, 2**32); got an id outside that range")
    return arr


def _token_id(value: object) -> int:
    """One token id of a sequence: an integer (not a bool), else a ConfigError naming its type."""
    if not isinstance(value, bool | np.bool_):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise ConfigError(f"token ids must be integers in [0, 2**32); got a {type(value).__name__}")


def encode_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Encode token ids as little-endian uint32 bytes (the hashed form).

    Raises :class:`ConfigError` as :func:`token_array` does.
    """
    return token_array(token_ids).astype("<u4", copy=False).tobytes()


def root_key(namespace: Namespace | None = None, algorithm: str = "sha256") -> BlockKey:
    """The parent of the first block of every prompt (the chain seed)."""
    h = _new_hasher(algorithm)
    h.update(_ROOT_SEED)
    if namespace is not None:
        h.update(namespace.digest)
    digest: bytes = h.digest()
    return digest


def chain_key(
    parent: BlockKey,
    token_ids: Sequence[int] | np.ndarray,
    extra: bytes = b"",
    algorithm: str = "sha256",
) -> BlockKey:
    """The key of one block given its parent's key, its tokens and extra keys.

    ``extra`` carries anything besides tokens that changes the block's KV (LoRA id,
    multimodal hashes, cache salt). Its length is hashed too, so the encoding is
    unambiguous.
    """
    h = _new_hasher(algorithm)
    h.update(parent)
    tok = encode_tokens(token_ids)
    h.update(len(tok).to_bytes(4, "little"))
    h.update(tok)
    h.update(extra)
    digest: bytes = h.digest()
    return digest


def prefix_keys(
    token_ids: Sequence[int] | np.ndarray,
    tokens_per_block: int,
    *,
    namespace: Namespace | None = None,
    extra: bytes = b"",
    algorithm: str = "sha256",
) -> list[BlockKey]:
    """Keys of every *full* block of a prompt, in order. A partial tail is not keyed."""
    if tokens_per_block <= 0:
        raise ConfigError(f"tokens_per_block must be positive, got {tokens_per_block}")
    arr = token_array(token_ids)
    parent = root_key(namespace, algorithm)
    keys: list[BlockKey] = []
    for start in range(0, len(arr) - tokens_per_block + 1, tokens_per_block):
        parent = chain_key(parent, arr[start : start + tokens_per_block], extra, algorithm)
        keys.append(parent)
    return keys


def chain_ids(ids: Iterable[int], namespace: Namespace | None = None) -> list[BlockKey]:
    """Keys for a chain of opaque block ids (e.g. a trace's ``hash_ids``).

    Each id stands for one block's content; the chain makes key ``i`` depend on
    ids ``0..i`` exactly as :func:`prefix_keys` does for tokens.
    """
    parent = root_key(namespace)
    out: list[BlockKey] = []
    for block_id in ids:
        parent = hashlib.sha256(parent + int(block_id).to_bytes(8, "little", signed=True)).digest()
        out.append(parent)
    return out


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one block of KV cache, as stored in a CPU row.

    ``kv_factor`` is 2 when K and V are stored separately and 1 for a latent
    (MLA) cache. ``bytes_per_block`` is the payload size of one block for the
    local parallel rank; a row of the shared region holds ``bytes_per_block``
    rounded up to the page size.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: str = "bfloat16"
    kv_factor: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"KVGeometry.{name} must be a positive integer, got {value!r}")
        if self.kv_factor not in (1, 2):
            raise ConfigError(f"KVGeometry.kv_factor must be 1 (MLA) or 2 (K and V), got {self.kv_factor}")
        dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        return self.kv_factor * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.tokens_per_block

    @classmethod
    def from_block_bytes(cls, block_bytes: int, tokens_per_block: int = 16) -> KVGeometry:
        """A synthetic geometry whose blocks are exactly ``block_bytes`` of uint8."""
        if block_bytes <= 0 or block_bytes % tokens_per_block:
            raise ConfigError(
                f"block_bytes ({block_bytes}) must be a positive multiple of tokens_per_block ({tokens_per_block})"
            )
        return cls(
            num_layers=1,
            num_kv_heads=1,
            head_dim=block_bytes // tokens_per_block,
            tokens_per_block=tokens_per_block,
            dtype="uint8",
            kv_factor=1,
        )


@dataclass(frozen=True)
class Namespace:
    """Everything that makes KV bytes incompatible between two engines.

    Equal namespaces share blocks in every tier; different ones never see each
    other's blocks. ``digest`` is 16 bytes of SHA-256 over a canonical JSON form.
    """

    model_id: str
    geometry: KVGeometry | None = None
    """The KV layout; ``None`` when the engine describes its layout in ``extra`` instead
    (its blocks are opaque bytes to kvtier, e.g. vLLM's)."""
    model_revision: str = ""
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    format_version: int = KEY_FORMAT_VERSION
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ConfigError("Namespace.model_id must be a non-empty model name")
        if self.geometry is not None and not isinstance(self.geometry, KVGeometry):
            raise ConfigError(
                f"Namespace.geometry must be a kvtier.KVGeometry, got a {type(self.geometry).__name__}: "
                "e.g. KVGeometry(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16)"
            )
        if self.geometry is None and not self.extra:
            raise ConfigError(
                "Namespace needs a KV geometry, or 'extra' entries that describe the engine's block layout"
            )
        if not (0 <= self.tp_rank < self.tp_size) or not (0 <= self.pp_rank < self.pp_size):
            raise ConfigError(
                f"parallel layout is inconsistent: tp_rank={self.tp_rank}/tp_size={self.tp_size}, "
                f"pp_rank={self.pp_rank}/pp_size={self.pp_size}"
            )

    def canonical(self) -> str:
        """The canonical JSON that the digest covers (sorted keys, no spaces)."""
        data = asdict(self)
        if self.geometry is not None:
            data["geometry"]["dtype"] = self.geometry.dtype.removeprefix("torch.").lower()
        data["extra"] = sorted(list(pair) for pair in self.extra)
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @functools.cached_property
    def digest(self) -> bytes:
        return hashlib.sha256(self.canonical().encode()).digest()[:16]

    @property
    def hexdigest(self) -> str:
        return self.digest.hex()


def session_digest(session: str) -> int:
    """The 64-bit digest under which a conversation's id (the ``kvtier_session`` hint) is
    remembered, by the policy's session clock and by learned admission alike: the id itself
    is never kept. Not cryptographic (a collision only merges two sessions' statistics); any
    string, lone surrogates included, has one."""
    return xxhash.xxh3_64_intdigest(session.encode("utf-8", "surrogatepass"))
