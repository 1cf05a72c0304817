"""On-disk layout of the filesystem tier, and the byte-moving primitives it uses.

One directory per namespace under the tier's root::

    <root>/<namespace hexdigest>/
        manifest.json            namespace, geometry, block size, format version
        00/ .. ff/               256 shards, by the first byte of the block key
            <key hex>.kv         one block: header page, then the payload
        tmp/<pid>-<token>/       one directory per live tier instance
            lock                 flock()ed while the instance lives
            <key hex>.<n>.tmp    a store in progress (linked into its shard)
        ledger/<pid>-<token>     each instance's count of value files (the shared
                                 size bound, :mod:`kvtier.tiers.fs_budget`)
        journal/<pid>-<token>.<n>  each instance's log of files it added and removed
                                 (live sharing, :mod:`kvtier.tiers.fs_journal`)

A value file holds the 128-byte header of :mod:`kvtier.tiers.format` at offset
0, zero padded to :data:`PAYLOAD_OFFSET` (4096), then the payload. The payload
is page aligned so that O_DIRECT can move it straight between the file and a
page-aligned CPU row. A file written with O_DIRECT is padded to a whole page;
one written through the page cache ends right after the payload. Both are valid.

Stores write a temporary file in the instance's own ``tmp`` directory and
link it into place (never replacing an entry there), so a reader never sees a
partial file. A temporary
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
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, CorruptValueError, UnsafeEntryError
from kvtier.tiers.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    ValueHeader,
    decode_header,
    payload_checksum,
    verify_payload,
)
from kvtier.tiers.fs_files import DIR_FLAGS, FileModes, NamespaceDir, classify_entry, create_file
from kvtier.untrusted import kind_of, open_regular, try_flock

logger = logging.getLogger(__name__)

PAGE = 4096
"""Alignment unit for O_DIRECT offsets, lengths and buffers."""

PAYLOAD_OFFSET = PAGE
"""Where the payload starts in a value file (the header page comes first)."""

LAYOUT_VERSION = 1
"""Version of this directory layout, recorded in the manifest."""

MANIFEST = "manifest.json"
TMP_DIR = "tmp"
LEDGER_DIR = "ledger"
JOURNAL_DIR = "journal"
LOCK_FILE = "lock"
SUFFIX = ".kv"
SHARDS = tuple(f"{i:02x}" for i in range(256))
_NAME_RE = re.compile(rf"^([0-9a-f]{{2,{2 * MAX_KEY_BYTES}}})\.kv$")
_READABLE_FORMATS = (1, FORMAT_VERSION)
_STALE_UNLOCKED_DIR_SECONDS = 60.0
_MAX_MANIFEST_BYTES = 1 << 20

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


def read_manifest(ns_dir: Path | int) -> dict[str, Any]:
    """Parse the manifest of a namespace directory (a path, or its open descriptor).

    Opened without following a link or blocking on a FIFO; raises OSError,
    :class:`UnsafeEntryError` or ValueError when it is unreadable.
    """
    if isinstance(ns_dir, int):
        fd = open_regular(MANIFEST, os.O_RDONLY, dir_fd=ns_dir)
    else:
        fd = open_regular(ns_dir / MANIFEST, os.O_RDONLY)
    with os.fdopen(fd, encoding="utf-8") as f:
        data = json.loads(f.read(_MAX_MANIFEST_BYTES))
    if not isinstance(data, dict):
        raise ValueError("manifest is not a JSON object")
    return data


def ensure_manifest(dirs: NamespaceDir, expected: dict[str, Any]) -> None:
    """Create the manifest, or check that the existing one describes the same data.

    Raises :class:`ConfigError` when the directory holds another namespace or
    block size (never read from or written to), naming the directory and the fix.
    """
    ns_dir = dirs.path
    path = ns_dir / MANIFEST
    try:
        found = read_manifest(dirs.fd)
    except FileNotFoundError:
        atomic_write_text(dirs, MANIFEST, json.dumps(expected, indent=2, sort_keys=True) + "\n")
        return
    except (OSError, ValueError, UnsafeEntryError) as exc:
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
        atomic_write_text(dirs, MANIFEST, json.dumps(upgraded, indent=2, sort_keys=True) + "\n")
        found = upgraded
    for entry in (
        "kvtier_fs_layout",
        "value_format_version",
        "namespace_digest",
        "namespace",
        "block_bytes",
        "payload_offset",
    ):
        if found.get(entry) != expected[entry]:
            raise ConfigError(
                f"fs tier directory {ns_dir} holds {entry}={found.get(entry)!r}, this engine needs "
                f"{expected[entry]!r}; it will not be read or written. Use another 'root' or remove "
                "the directory"
            )


def atomic_write_text(dirs: NamespaceDir, name: str, text: str) -> None:
    """Write ``text`` as ``name`` in the namespace directory: new temp file, fsync, rename."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = create_file(dirs.fd, tmp, 0, dirs.modes)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dirs.fd, dst_dir_fd=dirs.fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dirs.fd)
    os.fsync(dirs.fd)


def make_dirs(ns_dir: Path, modes: FileModes) -> NamespaceDir:
    """Create (or adopt) the namespace directory, its 256 shards, ``tmp``, ``ledger`` and
    ``journal``, following no link; see :class:`~kvtier.tiers.fs_files.NamespaceDir`."""
    return NamespaceDir(ns_dir, (*SHARDS, TMP_DIR, LEDGER_DIR, JOURNAL_DIR), modes)


# --- instance temp directories -----------------------------------------------------------------


class InstanceDir:
    """This process's temp directory under ``tmp``, held alive by an flock on its ``lock`` file.

    Opened without following links and used through its descriptor (``fd``).
    """

    def __init__(self, dirs: NamespaceDir) -> None:
        self.name = name = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = dirs.path / TMP_DIR / name
        tmp_fd = dirs.subdir(TMP_DIR)
        try:
            os.mkdir(name, dirs.modes.dir_mode, dir_fd=tmp_fd)
            self.fd = os.open(name, DIR_FLAGS, dir_fd=tmp_fd)
        finally:
            os.close(tmp_fd)
        try:
            if dirs.modes.group is not None:
                os.fchmod(self.fd, dirs.modes.dir_mode)
            # Read-only: an open writable file would keep the file system from being remounted ro.
            flags = os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._lock_fd: int | None = os.open(LOCK_FILE, flags, dirs.modes.file_mode, dir_fd=self.fd)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            self._lock_fd = None
            self.close(remove=True)
            raise
        self._seq = itertools.count(1)

    def temp_name(self, key: bytes) -> str:
        """A fresh temp file name for ``key``, unique within this instance (thread-safe)."""
        return f"{key.hex()}.{next(self._seq)}.tmp"

    def close(self, remove: bool = True) -> None:
        """Release the lock and (by default) remove the directory and its leftovers."""
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)  # fd-based: never follows a link
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class TempDirState:
    path: Path
    live: bool
    files: int
    ours: bool = True


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
            ours = entry.stat(follow_symlinks=False).st_uid == os.geteuid()
            files = sum(1 for e in os.scandir(path) if e.name != LOCK_FILE)
        except FileNotFoundError:
            continue
        yield TempDirState(path, _held_by_live_process(path), files, ours)


def instance_alive(ns_dir: Path, name: str) -> bool:
    """Is tier instance ``name`` (its ``tmp`` directory's name) alive? Proven by its flock."""
    if not name or name.startswith(".") or "/" in name:
        return False
    path = ns_dir / TMP_DIR / name
    try:
        if not stat.S_ISDIR(path.lstat().st_mode):
            return False  # a link or a file is no instance directory (kvtier never made one)
    except FileNotFoundError:
        return False
    return _held_by_live_process(path)


def _held_by_live_process(path: Path) -> bool:
    try:
        fd = open_regular(path / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        # A creator dies between mkdir and creating its lock only in a tiny window; an
        # unlocked directory older than a minute is certainly abandoned.
        try:
            return time.time() - path.lstat().st_mtime < _STALE_UNLOCKED_DIR_SECONDS
        except FileNotFoundError:
            return False
    except (OSError, UnsafeEntryError):
        return True  # a lock that is not a regular file: not proven dead, leave the directory alone
    try:
        return not try_flock(fd, exclusive=True)
    finally:
        os.close(fd)  # also drops the lock if we took it


def sweep_temp_dirs(ns_dir: Path) -> tuple[int, int]:
    """Remove the temp directories of dead instances; returns (directories, files) removed."""
    dirs = files = 0
    for state in temp_dirs(ns_dir):
        if state.live or not state.ours:
            continue
        shutil.rmtree(state.path, ignore_errors=True)  # fd-based: never follows a link
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
    fd: int,
    header_page: memoryview,
    payload: memoryview,
    *,
    namespace: bytes,
    key: bytes,
    block_bytes: int,
    fsync: bool,
    reuse: bool = False,
) -> int:
    """Write one value file through ``fd`` (a temp file; the caller renames it into place).

    ``header_page`` is a page-sized (page-aligned for O_DIRECT) scratch buffer; it is
    overwritten with the header and zero padding. ``payload`` is the CPU row: its first
    ``block_bytes`` are the block; with O_DIRECT it must be page aligned and a whole
    number of pages long (the padding is written too). One ``pwritev`` moves header
    and payload with no intermediate copy. Returns the file size. Raises OSError; a
    failed write leaves a partial temp file for the caller to unlink. With ``reuse``,
    the file is an evicted value being recycled: it is trimmed to size. The caller
    opens and closes ``fd`` (see :mod:`kvtier.tiers.fs_files`).
    """
    checksum = payload_checksum(payload[:block_bytes])
    header_page[:HEADER_SIZE] = ValueHeader(namespace, key, block_bytes, checksum).pack()
    header_page[HEADER_SIZE:PAYLOAD_OFFSET] = _ZERO_TAIL
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
    return total


def read_value(
    fd: int,
    size: int,
    header_page: memoryview,
    payload: memoryview,
    *,
    namespace: bytes,
    key: bytes,
    block_bytes: int,
    direct: bool,
    name: str = "",
) -> int:
    """Read and verify one value file (open as ``fd``, ``size`` bytes) straight into ``payload``.

    ``payload`` (the CPU row) must hold at least ``block_bytes``; with ``direct`` it is page
    aligned and page-rounded. Raises :class:`CorruptValueError` on any header, key,
    namespace, length or checksum mismatch (``payload`` then holds unverified bytes that
    must not be used), OSError on I/O failure. Returns the payload bytes read. ``name``
    is for messages.
    """
    if size not in (PAYLOAD_OFFSET + block_bytes, entry_bytes(block_bytes)):
        raise CorruptValueError(
            f"value file {name} has {size} bytes, expected {PAYLOAD_OFFSET + block_bytes} "
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
    header = decode_header(header_page[:HEADER_SIZE], namespace=namespace, key=key, payload_len=block_bytes)
    got = max(0, done - PAYLOAD_OFFSET)
    if got < block_bytes:
        raise CorruptValueError(f"value file {name} truncated: payload has {got} of {block_bytes} bytes")
    verify_payload(header, payload[:block_bytes])
    return block_bytes


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


# --- scanning and offline verification ----------------------------------------------------------


def scan_shard(dirs: NamespaceDir, shard: str, quiet: bool = False) -> tuple[list[tuple[float, bytes]], int]:
    """``(mtime, key)`` of every value file in one shard, and how many entries named like
    values were skipped as unsafe (not a regular file, or not ours; each logged unless
    ``quiet``). Follows no link."""
    out: list[tuple[float, bytes]] = []
    unsafe = 0
    for entry in dirs.entries(shard):
        key = parse_value_name(shard, entry.name)
        if key is None:
            continue
        try:
            st, reason = classify_entry(entry, dirs.modes)
        except FileNotFoundError:
            continue
        if st is None:
            unsafe += 1
            if not quiet:
                logger.warning("fs tier %s: skipping %s/%s: it is %s", dirs.path, shard, entry.name, reason)
            continue
        out.append((st.st_mtime, key))
    return out, unsafe


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
    unsafe_entries: list[CorruptEntry] = field(default_factory=list)
    """Entries named like values that are not regular files of this user: never opened."""

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
            "unsafe_entries": [{"path": c.path, "reason": c.reason} for c in self.unsafe_entries],
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


@dataclass
class _Verification:
    """What :func:`_verify_namespace` found so far, shard by shard."""

    digest: bytes
    block_bytes: int | None
    check_payloads: bool
    remove_corrupt: bool
    entries: int = 0
    total: int = 0
    verified: int = 0
    removed: int = 0
    corrupt: list[CorruptEntry] = field(default_factory=list)
    unsafe: list[CorruptEntry] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    buf: bytearray | None = None
    header: memoryview = field(default_factory=lambda: memoryview(bytearray(PAGE)))


def _verify_shard(ns_dir: Path, shard: str, v: _Verification) -> None:
    """Count (and with payload checks, read and verify) the values of one shard, following no link."""
    try:
        shard_fd = os.open(ns_dir / shard, DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError as exc:
        v.unsafe.append(CorruptEntry(str(ns_dir / shard), f"not a directory ({exc.strerror or exc})"))
        return
    try:
        for entry in sorted(os.scandir(shard_fd), key=lambda e: e.name):
            path = ns_dir / shard / entry.name
            key = parse_value_name(shard, entry.name)
            if key is None:
                v.foreign.append(str(path))
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                v.unsafe.append(CorruptEntry(str(path), kind_of(st.st_mode)))
                continue
            v.entries += 1
            v.total += st.st_size
            if v.check_payloads and v.block_bytes is not None:
                _verify_value(shard_fd, entry.name, path, key, st, v)
    finally:
        os.close(shard_fd)


def _verify_value(shard_fd: int, name: str, path: Path, key: bytes, st: os.stat_result, v: _Verification) -> None:
    assert v.block_bytes is not None
    if v.buf is None:
        v.buf = bytearray(v.block_bytes)
    try:
        fd = open_regular(name, os.O_RDONLY, dir_fd=shard_fd)
        try:
            read_value(fd, os.fstat(fd).st_size, v.header, memoryview(v.buf), namespace=v.digest, key=key,
                       block_bytes=v.block_bytes, direct=False, name=str(path))  # fmt: skip
        finally:
            os.close(fd)
        v.verified += 1
    except CorruptValueError as exc:
        v.corrupt.append(CorruptEntry(str(path), str(exc)))
        if v.remove_corrupt and st.st_uid == os.geteuid():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=shard_fd)
            v.removed += 1
    except UnsafeEntryError as exc:
        v.entries -= 1
        v.unsafe.append(CorruptEntry(str(path), exc.reason))
    except FileNotFoundError:
        v.entries -= 1
    except OSError as exc:
        v.corrupt.append(CorruptEntry(str(path), f"unreadable: {exc}"))


def _verify_namespace(ns_dir: Path, check_payloads: bool, remove_corrupt: bool) -> NamespaceReport:
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None
    try:
        manifest = read_manifest(ns_dir)
        if manifest.get("namespace_digest") != ns_dir.name:
            manifest_error = (
                f"manifest names namespace {manifest.get('namespace_digest')!r}, directory is {ns_dir.name}"
            )
    except (OSError, ValueError, UnsafeEntryError) as exc:
        manifest_error = f"unreadable manifest: {exc}"
    block_bytes = manifest.get("block_bytes") if manifest else None
    usable = manifest_error is None and isinstance(block_bytes, int) and block_bytes > 0
    digest = bytes.fromhex(ns_dir.name) if re.fullmatch(r"[0-9a-f]{32}", ns_dir.name) else b""
    v = _Verification(digest, block_bytes if usable else None, check_payloads, remove_corrupt)
    for shard in SHARDS:
        _verify_shard(ns_dir, shard, v)
    entries, total, verified, removed = v.entries, v.total, v.verified, v.removed
    corrupt, unsafe, foreign = v.corrupt, v.unsafe, v.foreign
    live = stale = 0
    for state in temp_dirs(ns_dir):
        if state.live:
            live += state.files
        else:
            stale += state.files
    for extra in sorted(ns_dir.iterdir()):
        if extra.name not in SHARDS and extra.name not in (MANIFEST, TMP_DIR, LEDGER_DIR, JOURNAL_DIR):
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
        unsafe_entries=unsafe,
        temp_files_live=live,
        temp_files_stale=stale,
    )
