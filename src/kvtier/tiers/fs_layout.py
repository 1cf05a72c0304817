"""On-disk layout of the filesystem tier, and the byte-moving primitives it uses.

One directory per namespace under the tier's root::

    <root>/<namespace hexdigest>/
        manifest.json            namespace, geometry, block size, format version
        00/ .. ff/               256 shards, by the first byte of the block key
            <key hex>.kv         one block: header page, then the payload
        tmp/<pid>-<token>/       one directory per live tier instance
            lock                 flock()ed while the instance lives
            <key hex>.<n>.tmp    a store in progress (renamed into its shard)

A value file holds the 128-byte header of :mod:`kvtier.tiers.format` at offset
0, zero padded to :data:`PAYLOAD_OFFSET` (4096), then the payload. The payload
is page aligned so that O_DIRECT can move it straight between the file and a
page-aligned CPU row. A file written with O_DIRECT is padded to a whole page;
one written through the page cache ends right after the payload. Both are valid.

Stores write a temporary file in the instance's own ``tmp`` directory and
rename it into place, so a reader never sees a partial file. A temporary
directory whose ``lock`` can be taken belongs to a dead process (the kernel
drops flocks on process death, SIGKILL included) and is swept at startup.

Everything here is plain functions over paths and file descriptors; the
:class:`~kvtier.tiers.fs.FilesystemTier` owns the threads that call them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, CorruptValueError
from kvtier.tiers.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    ValueHeader,
    decode_header,
    payload_checksum,
    verify_payload,
)

logger = logging.getLogger(__name__)

PAGE = 4096
"""Alignment unit for O_DIRECT offsets, lengths and buffers."""

PAYLOAD_OFFSET = PAGE
"""Where the payload starts in a value file (the header page comes first)."""

LAYOUT_VERSION = 1
"""Version of this directory layout, recorded in the manifest."""

MANIFEST = "manifest.json"
TMP_DIR = "tmp"
LOCK_FILE = "lock"
SUFFIX = ".kv"
SHARDS = tuple(f"{i:02x}" for i in range(256))
_NAME_RE = re.compile(rf"^([0-9a-f]{{2,{2 * MAX_KEY_BYTES}}})\.kv$")
_READABLE_FORMATS = (1, FORMAT_VERSION)
_STALE_UNLOCKED_DIR_SECONDS = 60.0

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_ZERO_TAIL = bytes(PAYLOAD_OFFSET - HEADER_SIZE)


def round_up(n: int, unit: int = PAGE) -> int:
    return -(-n // unit) * unit


def entry_bytes(block_bytes: int) -> int:
    """Bytes one value file may occupy: the header page plus the payload padded to a page."""
    return PAYLOAD_OFFSET + round_up(block_bytes)


def value_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def value_path(ns_dir: Path, key: bytes) -> Path:
    """``<ns_dir>/<first key byte as hex>/<key hex>.kv``."""
    return ns_dir / f"{key[0]:02x}" / value_name(key)


def parse_value_name(shard: str, name: str) -> bytes | None:
    """The key a file name stands for, or None if it is not a value file of ``shard``."""
    m = _NAME_RE.match(name)
    if m is None or len(m.group(1)) % 2 or not m.group(1).startswith(shard):
        return None
    return bytes.fromhex(m.group(1))


def aligned_buffer(size: int) -> mmap.mmap:
    """Zeroed anonymous memory, page aligned (usable as an O_DIRECT buffer)."""
    return mmap.mmap(-1, round_up(size))


# --- manifest ------------------------------------------------------------------------------


def manifest_dict(namespace_digest: bytes, namespace_canonical: str, block_bytes: int) -> dict[str, Any]:
    return {
        "kvtier_fs_layout": LAYOUT_VERSION,
        "value_format_version": FORMAT_VERSION,
        "namespace_digest": namespace_digest.hex(),
        "namespace": json.loads(namespace_canonical),
        "block_bytes": block_bytes,
        "payload_offset": PAYLOAD_OFFSET,
    }


def read_manifest(ns_dir: Path) -> dict[str, Any]:
    """Parse ``ns_dir/manifest.json``; raises OSError or ValueError when unreadable."""
    with open(ns_dir / MANIFEST, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError("manifest is not a JSON object")
    return data


def ensure_manifest(ns_dir: Path, expected: dict[str, Any]) -> None:
    """Create the manifest, or check that the existing one describes the same data.

    Raises :class:`ConfigError` when the directory holds another namespace or
    block size (never read from or written to), naming the directory and the fix.
    """
    path = ns_dir / MANIFEST
    try:
        found = read_manifest(ns_dir)
    except FileNotFoundError:
        atomic_write_text(path, json.dumps(expected, indent=2, sort_keys=True) + "\n")
        return
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"fs tier manifest {path} is unreadable ({exc}); the directory cannot be trusted: "
            f"remove {ns_dir} or point 'root' elsewhere"
        ) from exc
    found_format = found.get("value_format_version")
    if found_format in _READABLE_FORMATS and found_format != expected["value_format_version"]:
        # Written by a release that only knew format 1; this one reads it and may now write format 2
        # (keys over 32 bytes), so say so: a format-1-only release then refuses the directory
        # instead of taking format-2 values for corrupt ones.
        upgraded = dict(found, value_format_version=expected["value_format_version"])
        atomic_write_text(path, json.dumps(upgraded, indent=2, sort_keys=True) + "\n")
        found = upgraded
    for field in (
        "kvtier_fs_layout",
        "value_format_version",
        "namespace_digest",
        "namespace",
        "block_bytes",
        "payload_offset",
    ):
        if found.get(field) != expected[field]:
            raise ConfigError(
                f"fs tier directory {ns_dir} holds {field}={found.get(field)!r}, this engine needs "
                f"{expected[field]!r}; it will not be read or written. Use another 'root' or remove "
                "the directory"
            )


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(ns_dir: Path) -> None:
    """Create the namespace directory, its 256 shards and ``tmp`` (idempotent)."""
    ns_dir.mkdir(parents=True, exist_ok=True)
    for shard in SHARDS:
        (ns_dir / shard).mkdir(exist_ok=True)
    (ns_dir / TMP_DIR).mkdir(exist_ok=True)


# --- instance temp directories -----------------------------------------------------------------


class InstanceDir:
    """This process's temp directory, held alive by an flock on its ``lock`` file."""

    def __init__(self, ns_dir: Path) -> None:
        self.path = ns_dir / TMP_DIR / f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path.mkdir(parents=True)
        # Read-only: an open writable file would keep the file system from being remounted ro.
        flags = os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC
        self._lock_fd: int | None = os.open(self.path / LOCK_FILE, flags, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._seq = itertools.count(1)

    def temp_path(self, key: bytes) -> Path:
        """A fresh temp file name for ``key``, unique within this instance (thread-safe)."""
        return self.path / f"{key.hex()}.{next(self._seq)}.tmp"

    def ensure(self) -> None:
        """Recreate the directory if someone removed it (used by the health probe)."""
        self.path.mkdir(parents=True, exist_ok=True)

    def close(self, remove: bool = True) -> None:
        """Release the lock and (by default) remove the directory and its leftovers."""
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@dataclass
class TempDirState:
    path: Path
    live: bool
    files: int


def temp_dirs(ns_dir: Path) -> Iterator[TempDirState]:
    """Every instance temp directory, and whether a live process holds it."""
    base = ns_dir / TMP_DIR
    try:
        entries = list(os.scandir(base))
    except FileNotFoundError:
        return
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        try:
            files = sum(1 for e in os.scandir(path) if e.name != LOCK_FILE)
        except FileNotFoundError:
            continue
        yield TempDirState(path, _held_by_live_process(path), files)


def _held_by_live_process(path: Path) -> bool:
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        # A creator dies between mkdir and creating its lock only in a tiny window; an
        # unlocked directory older than a minute is certainly abandoned.
        try:
            return time.time() - path.stat().st_mtime < _STALE_UNLOCKED_DIR_SECONDS
        except FileNotFoundError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we took it
    return False


def sweep_temp_dirs(ns_dir: Path) -> tuple[int, int]:
    """Remove the temp directories of dead instances; returns (directories, files) removed."""
    dirs = files = 0
    for state in temp_dirs(ns_dir):
        if state.live:
            continue
        shutil.rmtree(state.path, ignore_errors=True)
        dirs += 1
        files += state.files
    if dirs:
        logger.info("fs tier %s: swept %d orphaned temp files in %d dead instance directories", ns_dir, files, dirs)
    return dirs, files


# --- O_DIRECT probe ----------------------------------------------------------------------------


def probe_direct_io(directory: Path) -> str | None:
    """Try an O_DIRECT write and read in ``directory``; None on success, else the reason."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    path = directory / f".direct-probe-{secrets.token_hex(4)}"
    buf = aligned_buffer(PAGE)
    view = memoryview(buf)
    try:
        view[:8] = b"kvtier!!"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            return f"open(O_DIRECT) failed: {exc.strerror}"
        try:
            if os.pwritev(fd, [view], 0) != PAGE:
                return "short O_DIRECT write"
            view[:8] = bytes(8)
            if os.preadv(fd, [view], 0) != PAGE or bytes(view[:8]) != b"kvtier!!":
                return "O_DIRECT read back different bytes"
        except OSError as exc:
            return f"O_DIRECT I/O failed: {exc.strerror}"
        finally:
            os.close(fd)
        return None
    finally:
        view.release()
        buf.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# --- value I/O ------------------------------------------------------------------------------


def write_value(
    path: Path,
    header_page: memoryview,
    payload: memoryview,
    *,
    namespace: bytes,
    key: bytes,
    block_bytes: int,
    direct: bool,
    fsync: bool,
    reuse: bool = False,
) -> int:
    """Write one value file at ``path`` (a temp path; the caller renames it into place).

    ``header_page`` is a page-sized (page-aligned for O_DIRECT) scratch buffer; it is
    overwritten with the header and zero padding. ``payload`` is the CPU row: its first
    ``block_bytes`` are the block; with ``direct`` it must be page aligned and a whole
    number of pages long (the padding is written too). One ``pwritev`` moves header
    and payload with no intermediate copy. Returns the file size. Raises OSError; a
    failed write leaves a partial temp file for the caller to unlink. With ``reuse``,
    ``path`` is an existing file (an evicted value renamed there) that is overwritten in
    place and trimmed to size.
    """
    checksum = payload_checksum(payload[:block_bytes])
    header_page[:HEADER_SIZE] = ValueHeader(namespace, key, block_bytes, checksum).pack()
    header_page[HEADER_SIZE:PAYLOAD_OFFSET] = _ZERO_TAIL
    flags = os.O_WRONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0)
    if not reuse:
        flags |= os.O_CREAT | os.O_EXCL
    fd = os.open(path, flags, 0o644)
    try:
        total = PAYLOAD_OFFSET + len(payload)
        done = os.pwritev(fd, [header_page, payload], 0)
        while done < total:  # short writes: rare, but legal
            if done < PAYLOAD_OFFSET:
                done += os.pwritev(fd, [header_page[done:], payload], done)
            else:
                done += os.pwrite(fd, payload[done - PAYLOAD_OFFSET :], done)
        if reuse:
            os.ftruncate(fd, total)  # the recycled file may have been longer
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return total


def read_value(
    path: Path,
    header_page: memoryview,
    payload: memoryview,
    *,
    namespace: bytes,
    key: bytes,
    block_bytes: int,
    direct: bool,
) -> int:
    """Read and verify one value file straight into ``payload`` (the CPU row).

    ``payload`` must hold at least ``block_bytes``; with ``direct`` it is page aligned and
    page-rounded. Raises :class:`CorruptValueError` on any header, key, namespace,
    length or checksum mismatch (``payload`` then holds unverified bytes that must not be
    used), FileNotFoundError when the file is gone, OSError on I/O failure. Returns the
    payload bytes read.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if direct else 0))
    try:
        size = os.fstat(fd).st_size
        if size not in (PAYLOAD_OFFSET + block_bytes, entry_bytes(block_bytes)):
            raise CorruptValueError(
                f"value file {path} has {size} bytes, expected {PAYLOAD_OFFSET + block_bytes} "
                f"or {entry_bytes(block_bytes)}"
            )
        want = PAYLOAD_OFFSET + len(payload)
        done = os.preadv(fd, [header_page, payload], 0)
        while 0 < done < want and not (direct and done % PAGE):
            if done < PAYLOAD_OFFSET:
                n = os.preadv(fd, [header_page[done:], payload], done)
            else:
                n = os.preadv(fd, [payload[done - PAYLOAD_OFFSET :]], done)
            if n == 0:
                break
            done += n
    finally:
        os.close(fd)
    header = decode_header(header_page[:HEADER_SIZE], namespace=namespace, key=key, payload_len=block_bytes)
    got = max(0, done - PAYLOAD_OFFSET)
    if got < block_bytes:
        raise CorruptValueError(f"value file {path} truncated: payload has {got} of {block_bytes} bytes")
    verify_payload(header, payload[:block_bytes])
    return block_bytes


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


# --- scanning and offline verification ----------------------------------------------------------


def scan_shard(ns_dir: Path, shard: str) -> list[tuple[float, bytes]]:
    """``(mtime, key)`` of every value file in one shard (a missing shard is empty)."""
    out: list[tuple[float, bytes]] = []
    try:
        entries = list(os.scandir(ns_dir / shard))
    except FileNotFoundError:
        return out
    for entry in entries:
        key = parse_value_name(shard, entry.name)
        if key is None:
            continue
        try:
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        out.append((mtime, key))
    return out


@dataclass
class CorruptEntry:
    path: str
    reason: str


@dataclass
class NamespaceReport:
    """Summary of one namespace directory of an fs tier root (see :func:`verify_root`)."""

    digest: str
    path: str
    manifest: dict[str, Any] | None
    manifest_error: str | None
    entries: int
    bytes: int
    verified: int
    corrupt: list[CorruptEntry]
    removed_corrupt: int
    foreign_files: list[str]
    temp_files_live: int
    temp_files_stale: int

    @property
    def ok(self) -> bool:
        return self.manifest_error is None and not self.corrupt

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "path": self.path,
            "model_id": (self.manifest or {}).get("namespace", {}).get("model_id"),
            "block_bytes": (self.manifest or {}).get("block_bytes"),
            "manifest": self.manifest,
            "manifest_error": self.manifest_error,
            "entries": self.entries,
            "bytes": self.bytes,
            "verified": self.verified,
            "corrupt": [{"path": c.path, "reason": c.reason} for c in self.corrupt],
            "removed_corrupt": self.removed_corrupt,
            "foreign_files": self.foreign_files,
            "temp_files_live": self.temp_files_live,
            "temp_files_stale": self.temp_files_stale,
            "ok": self.ok,
        }


@dataclass
class RootReport:
    """Result of :func:`verify_root`: one report per namespace directory."""

    root: str
    namespaces: list[NamespaceReport]

    @property
    def ok(self) -> bool:
        return all(ns.ok for ns in self.namespaces)

    @property
    def entries(self) -> int:
        return sum(ns.entries for ns in self.namespaces)

    @property
    def bytes(self) -> int:
        return sum(ns.bytes for ns in self.namespaces)

    @property
    def corrupt(self) -> int:
        return sum(len(ns.corrupt) for ns in self.namespaces)

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "ok": self.ok,
            "entries": self.entries,
            "bytes": self.bytes,
            "corrupt": self.corrupt,
            "namespaces": [ns.to_dict() for ns in self.namespaces],
        }


def verify_root(
    root: str | os.PathLike[str],
    *,
    namespace: str | None = None,
    check_payloads: bool = True,
    remove_corrupt: bool = False,
) -> RootReport:
    """Summarize (and optionally check every value of) an fs tier root, offline.

    For ``kvtier inspect DIR --verify``; needs no manager, no CPU region and no namespace
    object. ``root`` is the tier's ``root`` option (or one namespace directory inside
    it). ``namespace`` limits the report to one namespace digest (hex, a prefix is
    enough). With ``check_payloads`` every value's header and xxh3 checksum are read
    and verified (reads every byte: ~1 GB/s from a cold disk); without it, only names
    and sizes are checked. ``remove_corrupt`` deletes corrupt values (never while an
    engine may be writing them: a live tier only ever renames complete files into
    place, so this is safe, but it races with that tier's own index).

    Raises :class:`ConfigError` if ``root`` is not a directory. Blocking; any thread.
    """
    base = Path(root)
    if not base.is_dir():
        raise ConfigError(f"fs tier root {base} is not a directory: pass the tier's 'root' option")
    if (base / MANIFEST).is_file():
        candidates = [base]
    else:
        candidates = sorted(p for p in base.iterdir() if p.is_dir() and re.fullmatch(r"[0-9a-f]{32}", p.name))
    if namespace:
        candidates = [p for p in candidates if p.name.startswith(namespace.lower())]
    reports = [_verify_namespace(p, check_payloads, remove_corrupt) for p in candidates]
    return RootReport(str(base), reports)


def _verify_namespace(ns_dir: Path, check_payloads: bool, remove_corrupt: bool) -> NamespaceReport:
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None
    try:
        manifest = read_manifest(ns_dir)
        if manifest.get("namespace_digest") != ns_dir.name:
            manifest_error = (
                f"manifest names namespace {manifest.get('namespace_digest')!r}, directory is {ns_dir.name}"
            )
    except (OSError, ValueError) as exc:
        manifest_error = f"unreadable manifest: {exc}"
    block_bytes = manifest.get("block_bytes") if manifest else None
    usable = manifest_error is None and isinstance(block_bytes, int) and block_bytes > 0
    digest = bytes.fromhex(ns_dir.name) if re.fullmatch(r"[0-9a-f]{32}", ns_dir.name) else b""

    entries = total = verified = removed = 0
    corrupt: list[CorruptEntry] = []
    foreign: list[str] = []
    buf: bytearray | None = None
    header = memoryview(bytearray(PAGE))
    for shard in SHARDS:
        try:
            names = sorted(os.listdir(ns_dir / shard))
        except FileNotFoundError:
            continue
        for name in names:
            path = ns_dir / shard / name
            key = parse_value_name(shard, name)
            if key is None:
                foreign.append(str(path))
                continue
            entries += 1
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
            if not (check_payloads and usable):
                continue
            assert isinstance(block_bytes, int)
            if buf is None:
                buf = bytearray(block_bytes)
            try:
                read_value(
                    path, header, memoryview(buf), namespace=digest, key=key, block_bytes=block_bytes, direct=False
                )
                verified += 1
            except CorruptValueError as exc:
                corrupt.append(CorruptEntry(str(path), str(exc)))
                if remove_corrupt:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    removed += 1
            except FileNotFoundError:
                entries -= 1
            except OSError as exc:
                corrupt.append(CorruptEntry(str(path), f"unreadable: {exc}"))
    live = stale = 0
    for state in temp_dirs(ns_dir):
        if state.live:
            live += state.files
        else:
            stale += state.files
    for extra in sorted(ns_dir.iterdir()):
        if extra.name not in SHARDS and extra.name not in (MANIFEST, TMP_DIR):
            foreign.append(str(extra))
    return NamespaceReport(
        digest=ns_dir.name,
        path=str(ns_dir),
        manifest=manifest,
        manifest_error=manifest_error,
        entries=entries,
        bytes=total,
        verified=verified,
        corrupt=corrupt,
        removed_corrupt=removed,
        foreign_files=foreign,
        temp_files_live=live,
        temp_files_stale=stale,
    )
