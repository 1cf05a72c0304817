"""On-disk layout of the filesystem tier, and the byte-moving primitives it uses.

One directory per namespace under the tier's root::

    <root>/<namespace hexdigest>/
        manifest.json            namespace, geometry, block size, format version
        store-id                 the directory's identity: 32 random hex digits and a
                                 newline, made once by the first engine to adopt it
                                 (:func:`ensure_store_id`; part of the fleet's store id)
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
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, CorruptValueError, ForeignFormatError, UnsafeEntryError
from kvtier.tiers.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    PREFIX_SIZE,
    ValueHeader,
    decode_header,
    foreign_format,
    older_readable_format,
    payload_checksum,
    payload_hasher,
    verify_payload,
)
from kvtier.tiers.fs_files import (
    DIR_FLAGS,
    NO_HARD_LINKS,
    FileModes,
    NamespaceDir,
    classify_entry,
    create_file,
    discard_corrupt,
    hold_at_name,
)
from kvtier.untrusted import kind_of, open_regular, try_flock

logger = logging.getLogger(__name__)

PAGE = 4096
"""Alignment unit for O_DIRECT offsets, lengths and buffers."""

PAYLOAD_OFFSET = PAGE
"""Where the payload starts in a value file (the header page comes first)."""

LAYOUT_VERSION = 1
"""Version of this directory layout, recorded in the manifest."""

MANIFEST = "manifest.json"
STORE_ID = "store-id"
"""The namespace directory's identity (:func:`ensure_store_id`)."""
TMP_DIR = "tmp"
LEDGER_DIR = "ledger"
JOURNAL_DIR = "journal"
LOCK_FILE = "lock"
NEW_LOCK_FILE = "lock.new"
"""An instance's lock while it is being created (:class:`InstanceDir`), before it is locked and renamed ``lock``."""
SUFFIX = ".kv"
SHARDS = tuple(f"{i:02x}" for i in range(256))
_NAME_RE = re.compile(rf"^([0-9a-f]{{2,{2 * MAX_KEY_BYTES}}})\.kv\Z")
_STALE_UNLOCKED_DIR_SECONDS = 60.0
_MAX_MANIFEST_BYTES = 1 << 20
_STORE_ID_RE = re.compile(rb"[0-9a-f]{32}\n")
_STORE_ID_BYTES = 33
_STORE_ID_PARTIAL_RE = re.compile(rb"[0-9a-f]{0,32}")
_STORE_ID_WAIT = 2.0
"""Seconds a partly written identity is waited for (one created in place: a root without hard links)."""

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


def read_manifest(ns_dir: Path | int, modes: FileModes | None = None) -> dict[str, Any]:
    """Parse the manifest of a namespace directory (a path, or its open descriptor).

    Opened without following a link or blocking on a FIFO; raises OSError,
    :class:`UnsafeEntryError` or ValueError when it is unreadable, and
    :class:`UnsafeEntryError` when ``modes`` is given and the file is not one
    they trust (another user's, outside the shared group).
    """
    if isinstance(ns_dir, int):
        fd = open_regular(MANIFEST, os.O_RDONLY, dir_fd=ns_dir)
    else:
        fd = open_regular(ns_dir / MANIFEST, os.O_RDONLY)
    if modes is not None:
        st = os.fstat(fd)
        if not modes.trusted(st):
            os.close(fd)
            raise UnsafeEntryError(MANIFEST, f"owned by uid {st.st_uid} (gid {st.st_gid}), not a file of ours")
    with os.fdopen(fd, encoding="utf-8") as f:
        text = f.read(_MAX_MANIFEST_BYTES)
    try:
        data = json.loads(text)
    except RecursionError:  # planted: thousands of nested arrays fit under the size limit
        raise ValueError("manifest is nested too deeply to be one") from None
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
        found = read_manifest(dirs.fd, dirs.modes)
    except FileNotFoundError:
        atomic_write_text(dirs, MANIFEST, json.dumps(expected, indent=2, sort_keys=True) + "\n")
        return
    except UnsafeEntryError as exc:
        raise ConfigError(
            f"fs tier manifest {path} is not a regular file of ours ({exc.reason}); the directory cannot be "
            f"trusted: remove {ns_dir} or point 'root' elsewhere"
        ) from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"fs tier manifest {path} is unreadable ({exc}); the directory cannot be trusted: "
            f"remove {ns_dir} or point 'root' elsewhere"
        ) from exc
    entries = ("kvtier_fs_layout", "value_format_version", "namespace_digest", "namespace", "block_bytes",
               "payload_offset")  # fmt: skip
    if older_readable_format(found.get("value_format_version")):
        # Written by a release that only knew format 1; this one reads it and may now write format 2
        # (keys over 32 bytes), so say so: a format-1-only release then refuses the directory
        # instead of taking format-2 values for corrupt ones. Only a manifest that matches in
        # everything else is rewritten: another namespace's or block size's stays as it is.
        upgraded = dict(found, value_format_version=expected["value_format_version"])
        if all(upgraded.get(entry) == expected[entry] for entry in entries):
            atomic_write_text(dirs, MANIFEST, json.dumps(upgraded, indent=2, sort_keys=True) + "\n")
        found = upgraded  # (else it is refused below for what else differs, not for its format)
    for entry in entries:
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


# --- store identity ---------------------------------------------------------------------------


def read_store_id(ns_fd: int, modes: FileModes | None = None, *, wait: float = _STORE_ID_WAIT) -> str | None:
    """The identity in the namespace directory open as ``ns_fd`` (32 lowercase hex digits), or
    None when it has none (a directory of an older release, or a new one).

    Opened without following a link or blocking on a FIFO. Raises :class:`UnsafeEntryError` when
    ``store-id`` is not a regular file, or (``modes`` given) not one they trust (another user's,
    outside the shared group); ValueError when it holds anything but one identity and a newline;
    OSError when it cannot be read. A file that holds the start of one (an engine creating it in
    place, on a root without hard links) is read again for up to ``wait`` seconds.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            fd = open_regular(STORE_ID, os.O_RDONLY, dir_fd=ns_fd)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if modes is not None and not modes.trusted(st):
                raise UnsafeEntryError(STORE_ID, modes.why_untrusted(st))
            data = os.pread(fd, _STORE_ID_BYTES + 1, 0)
        finally:
            os.close(fd)
        if _STORE_ID_RE.fullmatch(data):
            return data[:32].decode()
        if _STORE_ID_PARTIAL_RE.fullmatch(data) and time.monotonic() < deadline:
            time.sleep(0.01)
            continue
        shown = data[:_STORE_ID_BYTES] + (b"..." if len(data) > _STORE_ID_BYTES else b"")
        raise ValueError(f"it holds {shown!r}, not 32 lowercase hex digits and a newline")


def ensure_store_id(dirs: NamespaceDir, tmp_fd: int) -> str:
    """The identity of the namespace directory (32 lowercase hex digits): read from its
    ``store-id``, or, where there is none (a new directory, or one an older release made), made
    now, once for every engine that adopts this directory.

    Every engine that sees this very directory (one host's engines, hosts mounting it over NFS)
    reads the same identity; a directory at the same path on another disk (each host's local
    NVMe mounted at one path), or one made anew where an old one was, has another. Engines
    making it at the same moment agree: each writes a random identity to a file in ``tmp_fd``
    (its instance's temp directory: a leftover is swept with it) and hard-links it into place,
    which fails if another engine's is there already, whose identity is then read. On a file
    system without hard links it is created in place (``O_EXCL``) and written; an engine reading
    it meanwhile waits for the rest (:func:`read_store_id`).

    Raises :class:`ConfigError` naming the file and the fix when ``store-id`` is not a regular
    file of ours (or of the shared group) holding one identity: kvtier never wrote it, and it is
    neither followed nor removed. Raises OSError when it cannot be written (a full disk).
    """
    path = dirs.path / STORE_ID
    for _ in range(5):
        try:
            found = read_store_id(dirs.fd, dirs.modes)
        except UnsafeEntryError as exc:
            raise ConfigError(
                f"fs tier store identity {path} is not a regular file of ours ({exc.reason}): kvtier never made "
                "it, and neither follows nor removes it. Remove it (the next engine to start makes a new one) "
                "or point 'root' elsewhere"
            ) from None
        except ValueError as exc:
            raise ConfigError(
                f"fs tier store identity {path} is not one kvtier wrote ({exc}). Remove it (the next engine "
                "to start makes a new one) or point 'root' elsewhere"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"fs tier store identity {path} is unreadable ({exc.strerror or exc}): make it readable, "
                "remove it (the next engine to start makes a new one) or point 'root' elsewhere"
            ) from exc
        if found is not None:
            return found
        made = secrets.token_hex(16)
        if _place_store_id(dirs, tmp_fd, made):
            return made
        # Another engine's is there now (or was, and went again: read once more).
    raise ConfigError(f"fs tier store identity {path} keeps vanishing: another process removes it; stop it")


def _place_store_id(dirs: NamespaceDir, tmp_fd: int, made: str) -> bool:
    """Put identity ``made`` at ``store-id`` unless something is there; True if it now stands there."""
    text = (made + "\n").encode()
    tmp = f"{STORE_ID}.{secrets.token_hex(4)}.tmp"
    fd = create_file(tmp_fd, tmp, 0, dirs.modes)
    try:
        try:
            if os.write(fd, text) != len(text):
                raise OSError(errno.EIO, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, STORE_ID, src_dir_fd=tmp_fd, dst_dir_fd=dirs.fd, follow_symlinks=False)
        except FileExistsError:
            # NFS: a retransmitted LINK whose first try succeeded answers EEXIST; then ours has 2 links.
            if os.stat(tmp, dir_fd=tmp_fd, follow_symlinks=False).st_nlink <= 1:
                return False
        except OSError as exc:
            if exc.errno not in NO_HARD_LINKS:
                raise
            return _create_store_id_in_place(dirs, text)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=tmp_fd)
    os.fsync(dirs.fd)
    return True


def _create_store_id_in_place(dirs: NamespaceDir, text: bytes) -> bool:
    """A root without hard links: create ``store-id`` exclusively and write it (readers wait for a
    partly written one); False if something is there."""
    try:
        fd = create_file(dirs.fd, STORE_ID, 0, dirs.modes)
    except FileExistsError:
        return False
    try:
        if os.write(fd, text) != len(text):
            raise OSError(errno.EIO, "short write")
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):  # ours, half written: no engine may adopt it
            os.unlink(STORE_ID, dir_fd=dirs.fd)
        raise
    os.close(fd)
    os.fsync(dirs.fd)
    return True


def _store_id_problem(ns_fd: int) -> str | None:
    """Why engines refuse the namespace directory's ``store-id`` (for :func:`verify_root`), or None
    (one identity, or none yet). Not waited for, owner not checked."""
    try:
        read_store_id(ns_fd, wait=0)
    except UnsafeEntryError as exc:
        return f"{exc.reason}, not a store identity: not followed; engines refuse the directory until it is removed"
    except ValueError as exc:
        return f"not a store identity ({exc}): engines refuse the directory until it is removed"
    except OSError as exc:
        return f"store identity unreadable ({exc.strerror or exc}): engines refuse the directory"
    return None


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
        self.name = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = dirs.path / TMP_DIR / self.name
        self._dirs = dirs
        tmp_fd = dirs.subdir(TMP_DIR)
        try:
            os.mkdir(self.name, dirs.modes.dir_mode, dir_fd=tmp_fd)
            self.fd = os.open(self.name, DIR_FLAGS, dir_fd=tmp_fd)
        finally:
            os.close(tmp_fd)
        self._lock_fd: int | None = None
        try:
            if dirs.modes.group is not None:
                os.fchmod(self.fd, dirs.modes.dir_mode)
            # Read-only: an open writable file would keep the file system from being remounted ro.
            flags = os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._lock_fd = os.open(NEW_LOCK_FILE, flags, dirs.modes.file_mode, dir_fd=self.fd)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Named ``lock`` only once locked: an engine starting meanwhile, sweeping the dead
            # instances' directories, finds no lock (a young directory: alive) or a held one; it
            # could otherwise take a just-created lock first and remove this live directory.
            # (A rename, not a link: roots on file systems without hard links work too. It could
            # replace only what another writer of the root put in this new directory.)
            os.rename(NEW_LOCK_FILE, LOCK_FILE, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            self._lock_fd = None
            self.close(remove=True)
            raise
        self._seq = itertools.count(1)

    def temp_name(self, key: bytes) -> str:
        """A fresh temp file name for ``key``, unique within this instance (thread-safe)."""
        return f"{key.hex()}.{next(self._seq)}.tmp"

    def close(self, remove: bool = True) -> None:
        """Release the lock and (by default) remove the directory and its leftovers, through descriptors."""
        if remove and self.fd >= 0:
            with contextlib.suppress(OSError):
                tmp_fd = self._dirs.subdir(TMP_DIR)
                try:
                    _remove_flat_dir(tmp_fd, self.name, self.fd)
                finally:
                    os.close(tmp_fd)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _remove_flat_dir(parent_fd: int, name: str, fd: int) -> int:
    """Unlink every non-directory entry of the directory open as ``fd`` (``name`` under
    ``parent_fd``), then remove it if it is empty; returns the entries unlinked.

    Through descriptors only: a link is removed, never followed; a subdirectory (which no
    instance directory has) keeps the directory in place.
    """
    removed = 0
    for entry in list(os.scandir(fd)):
        if entry.is_dir(follow_symlinks=False):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.name, dir_fd=fd)
            removed += 1
    with contextlib.suppress(OSError):  # not empty, or gone: left as it is
        os.rmdir(name, dir_fd=parent_fd)
    return removed


@dataclass
class TempDirState:
    path: Path
    live: bool
    files: int
    ours: bool = True


def _open_subdir(parent_fd: int, name: str) -> int | None:
    """``name`` under ``parent_fd`` opened as a directory without following; None if it is
    missing or anything but a directory."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None


def instance_alive(ns_dir: Path, name: str) -> bool:
    """Is tier instance ``name`` (its ``tmp`` directory's name) alive? Proven by its flock.

    ``tmp`` and the instance directory are opened without following: a link or a file is no
    instance directory (kvtier never made one), and a missing one is dead. One that cannot be
    opened for another reason (EACCES: a mode that keeps this user out) is not proven dead and
    counts as alive: its ledger is not adopted from under it nor its journal deleted.
    """
    if not name or name.startswith(".") or "/" in name:
        return False
    try:
        tmp_fd = os.open(ns_dir / TMP_DIR, DIR_FLAGS)
    except OSError as exc:
        return not _proves_absent(exc)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=tmp_fd)
    except OSError as exc:
        return not _proves_absent(exc)
    finally:
        os.close(tmp_fd)
    try:
        return _held_by_live_process(fd, os.fstat(fd))
    finally:
        os.close(fd)


def _proves_absent(exc: OSError) -> bool:
    """Does a failed directory open show there is no such directory (nothing, a link, a file)?"""
    return exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR)


INSTANCE_NAME = r"\d{1,10}-[0-9a-f]{12}"
"""The pattern of an instance's name (:class:`InstanceDir`): ``<pid>-<12 hex>``; its temp
directory and its journal segments are named after it."""
INSTANCE_NAME_RE = re.compile(INSTANCE_NAME + r"\Z")


def temp_dirs(ns_fd: int, ns_path: Path, remove_dead: bool = False) -> list[TempDirState]:
    """Every instance temp directory of the namespace directory open as ``ns_fd``, and whether
    a live process holds it; with ``remove_dead``, the dead ones of this user are removed.

    Walks through descriptors only, following no link (``tmp`` or an entry in it that is
    not a directory is left alone), and only directories named like an instance's
    (:data:`INSTANCE_NAME_RE`): anything else in ``tmp`` is not proven kvtier's, and is left alone.
    """
    tmp_fd = _open_subdir(ns_fd, TMP_DIR)
    if tmp_fd is None:
        return []
    found: list[TempDirState] = []
    try:
        for entry in list(os.scandir(tmp_fd)):
            if not INSTANCE_NAME_RE.match(entry.name):
                continue
            fd = _open_subdir(tmp_fd, entry.name)
            if fd is None:
                continue
            try:
                st = os.fstat(fd)
                state = TempDirState(
                    ns_path / TMP_DIR / entry.name,
                    _held_by_live_process(fd, st),
                    sum(1 for e in os.scandir(fd) if e.name not in (LOCK_FILE, NEW_LOCK_FILE)),
                    st.st_uid == os.geteuid(),
                )
                if remove_dead and not state.live and state.ours:
                    _remove_flat_dir(tmp_fd, entry.name, fd)
            finally:
                os.close(fd)
            found.append(state)
    finally:
        os.close(tmp_fd)
    return found


def _held_by_live_process(dir_fd: int, st: os.stat_result) -> bool:
    """Is the instance directory open as ``dir_fd`` (``st`` its fstat) held by a live process?"""
    try:
        fd = open_regular(LOCK_FILE, os.O_RDONLY, dir_fd=dir_fd)
    except FileNotFoundError:
        # A creator dies between mkdir and creating its lock only in a tiny window; an
        # unlocked directory older than a minute is certainly abandoned.
        return time.time() - st.st_mtime < _STALE_UNLOCKED_DIR_SECONDS
    except (OSError, UnsafeEntryError):
        return True  # a lock that is not a regular file: not proven dead, leave the directory alone
    try:
        return not try_flock(fd, exclusive=True)
    finally:
        os.close(fd)  # also drops the lock if we took it


def sweep_temp_dirs(dirs: NamespaceDir) -> tuple[int, int]:
    """Remove the temp directories of dead instances; returns (directories, files) removed."""
    gone = [s for s in temp_dirs(dirs.fd, dirs.path, remove_dead=True) if not s.live and s.ours]
    files = sum(s.files for s in gone)
    if gone:
        logger.info(
            "fs tier %s: swept %d orphaned temp files in %d dead instance directories", dirs.path, files, len(gone)
        )
    return len(gone), files


# --- O_DIRECT probe ----------------------------------------------------------------------------


def probe_direct_io(dir_fd: int) -> str | None:
    """Try an O_DIRECT write and read in the directory open as ``dir_fd`` (an instance's own);
    None on success (or when the file system took the O_DIRECT open but is full: ENOSPC, EDQUOT),
    else the reason."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    name = f".direct-probe-{secrets.token_hex(4)}"
    buf = aligned_buffer(PAGE)
    view = memoryview(buf)
    try:
        view[:8] = b"kvtier!!"
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | O_DIRECT | os.O_CLOEXEC
            fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        except OSError as exc:
            return f"open(O_DIRECT) failed: {exc.strerror}"
        try:
            if os.pwritev(fd, [view], 0) != PAGE:
                return "short O_DIRECT write"
            view[:8] = bytes(8)
            if os.preadv(fd, [view], 0) != PAGE or bytes(view[:8]) != b"kvtier!!":
                return "O_DIRECT read back different bytes"
        except OSError as exc:
            if is_no_space(exc):
                # A full disk (a tier that filled it, restarted) took the O_DIRECT open and the write
                # got as far as allocating: not a reason to read buffered for the whole run, nor to
                # refuse direct_io=true. Stores hit ENOSPC anyway and are handled as such.
                return None
            return f"O_DIRECT I/O failed: {exc.strerror}"
        finally:
            os.close(fd)
        return None
    finally:
        view.release()
        buf.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


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
    must not be used; :class:`ForeignFormatError` for another release's format), OSError on I/O
    failure. Returns the payload bytes read. ``name`` is for messages.
    """
    sizes = sorted({PAYLOAD_OFFSET + block_bytes, entry_bytes(block_bytes)})
    if size not in sizes:
        got = os.preadv(fd, [header_page], 0)  # the aligned page: a direct read needs one
        version = foreign_format(header_page[: min(got, PREFIX_SIZE)])
        if version is not None:  # another release's layout may have another size
            raise ForeignFormatError(
                f"value file {name}: unsupported value format version {version}, another release's"
            )
        raise CorruptValueError(f"value file {name} has {size} bytes, expected {' or '.join(map(str, sizes))}")
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
    """Entries named like values that are not regular files of this user: never opened; and a
    ``store-id`` engines refuse (a link, a FIFO, not an identity): never removed."""
    unreadable: list[CorruptEntry] = field(default_factory=list)
    """Entries whose read failed (a 403, a 5xx, a timeout): not checked, kept, not counted as corrupt."""
    kept: list[CorruptEntry] = field(default_factory=list)
    """Entries read but not proven corrupt (another release's value; a block whose own header and
    checksum verify though its size disagrees with the manifest): kept, not counted as corrupt."""

    @property
    def ok(self) -> bool:
        return self.manifest_error is None and not self.corrupt and not self.unreadable

    def to_dict(self) -> dict[str, Any]:
        return {
            "digest": self.digest,
            "path": self.path,
            "model_id": _model_id(self.manifest),
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
            "unreadable": [{"path": c.path, "reason": c.reason} for c in self.unreadable],
            "kept": [{"path": c.path, "reason": c.reason} for c in self.kept],
            "ok": self.ok,
        }


@dataclass
class RootReport:
    """Result of :func:`verify_root`: one report per namespace directory."""

    root: str
    namespaces: list[NamespaceReport]
    unsafe_entries: list[CorruptEntry] = field(default_factory=list)
    """Entries of the root named like namespace directories that are not directories
    (symbolic links included): never followed."""
    foreign_entries: list[str] = field(default_factory=list)
    """S3: objects under the prefix outside any namespace (a first folder not named by a 32-hex
    digest: another application's, a console's folder marker), or the folders holding them
    where the client cannot list them: listed, never touched, not a failure. An fs root's
    other entries are skipped."""

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

    @property
    def unreadable(self) -> int:
        return sum(len(ns.unreadable) for ns in self.namespaces)

    @property
    def kept(self) -> int:
        return sum(len(ns.kept) for ns in self.namespaces)

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "ok": self.ok,
            "entries": self.entries,
            "bytes": self.bytes,
            "corrupt": self.corrupt,
            "unreadable": self.unreadable,
            "kept": self.kept,
            "namespaces": [ns.to_dict() for ns in self.namespaces],
            "unsafe_entries": [{"path": c.path, "reason": c.reason} for c in self.unsafe_entries],
            "foreign_entries": self.foreign_entries,
        }


_NAMESPACE_RE = re.compile(r"[0-9a-f]{32}")


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
    and sizes are checked. ``remove_corrupt`` deletes corrupt values of this user (never
    while an engine may be writing them: a live tier only ever renames complete files
    into place; a value that replaced a corrupt one meanwhile is kept). Each value is read as a
    tier reads it (share-locked, still at its name): one a live engine is recycling is skipped
    as gone, never judged half rewritten.

    Walks like the tier itself: ``root`` is opened as named, everything below it through
    directory descriptors, following no link (a namespace or shard directory that is a
    link is reported in ``unsafe_entries``, never entered), opening only regular files,
    never blocking on one, so nothing outside the root is read or deleted.

    Raises :class:`ConfigError` if ``root`` is not a directory. Blocking; any thread.
    """
    base = Path(root)
    try:
        root_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        what = {errno.ENOENT: "does not exist", errno.ENOTDIR: "is not a directory"}.get(
            exc.errno or 0, f"cannot be opened ({exc.strerror})")
        raise ConfigError(f"fs tier root {base} {what}: give the directory of an fs tier (its 'root' option)") from None
    prefix = (namespace or "").lower()
    reports: list[NamespaceReport] = []
    unsafe: list[CorruptEntry] = []
    try:
        names = sorted(e.name for e in os.scandir(root_fd))
        # The root is one namespace directory if it holds a manifest and is named like one, or
        # holds no directory named like one (a namespace directory renamed): a stray manifest.json
        # in a root of namespaces must not hide them.
        if _kind_at(root_fd, MANIFEST) == stat.S_IFREG:
            named = _opened_name(base, root_fd)
            if _NAMESPACE_RE.fullmatch(named) or not any(_NAMESPACE_RE.fullmatch(n) for n in names):
                if named.startswith(prefix):
                    reports.append(_verify_namespace(root_fd, base, check_payloads, remove_corrupt, named))
                return RootReport(str(base), reports)
        for name in names:
            if not _NAMESPACE_RE.fullmatch(name) or not name.startswith(prefix):
                continue
            ns_fd = _open_subdir(root_fd, name)
            if ns_fd is None:
                kind = _kind_at(root_fd, name)
                if kind is not None:
                    unsafe.append(CorruptEntry(str(base / name), kind_of(kind) + ", not a directory: not followed"))
                continue
            try:
                reports.append(_verify_namespace(ns_fd, base / name, check_payloads, remove_corrupt))
            finally:
                os.close(ns_fd)
    finally:
        os.close(root_fd)
    return RootReport(str(base), reports, unsafe)


def _unsafe_in_tmp(ns_fd: int, ns_dir: Path) -> list[CorruptEntry]:
    """``tmp`` itself, or the entries in it, that are not directories (links included): never
    entered; and directories in it not named like an instance's: left alone."""
    kind = _kind_at(ns_fd, TMP_DIR)
    if kind is not None and kind != stat.S_IFDIR:
        return [CorruptEntry(str(ns_dir / TMP_DIR), kind_of(kind) + ", not a directory: not followed")]
    tmp_fd = _open_subdir(ns_fd, TMP_DIR)
    if tmp_fd is None:
        return []
    try:
        found = []
        for e in sorted(os.scandir(tmp_fd), key=lambda e: e.name):
            kind = _kind_at(tmp_fd, e.name)
            if kind is None:
                continue
            if kind != stat.S_IFDIR:
                why = kind_of(kind) + ", not a directory: not followed"
            elif not INSTANCE_NAME_RE.match(e.name):
                why = "a directory not named like an instance's: left alone"
            else:
                continue
            found.append(CorruptEntry(str(ns_dir / TMP_DIR / e.name), why))
        return found
    finally:
        os.close(tmp_fd)


def _kind_at(dir_fd: int, name: str) -> int | None:
    """The file type (``S_IFMT``) of ``name`` under ``dir_fd``, not following; None if missing."""
    try:
        return stat.S_IFMT(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return None


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
    kept: list[CorruptEntry] = field(default_factory=list)
    unsafe: list[CorruptEntry] = field(default_factory=list)
    unreadable: list[CorruptEntry] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    buf: bytearray | None = None
    header: memoryview = field(default_factory=lambda: memoryview(bytearray(PAGE)))
    modes: FileModes = field(default_factory=lambda: FileModes.for_group(None))


def _verify_shard(ns_fd: int, ns_dir: Path, shard: str, v: _Verification) -> None:
    """Count (and with payload checks, read and verify) the values of one shard, following no link."""
    shard_fd = _open_subdir(ns_fd, shard)
    if shard_fd is None:
        kind = _kind_at(ns_fd, shard)
        if kind is not None:
            v.unsafe.append(CorruptEntry(str(ns_dir / shard), kind_of(kind) + ", not a directory: not followed"))
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
                _verify_value(shard_fd, entry.name, path, key, v)
    finally:
        os.close(shard_fd)


def _verify_value(shard_fd: int, name: str, path: Path, key: bytes, v: _Verification) -> None:
    """Read and verify one value as a tier reads it. A value that fails against the manifest is
    judged by its own header and checksum before it counts as corrupt (and may be removed): one
    that verifies so is kept, the manifest the suspect (a manifest edited or planted with another
    block_bytes must not condemn every value). One whose read fails (EIO, a mode that keeps this
    user out) is listed unreadable: not checked, kept. Buffers only a file of the manifest's size."""
    block_bytes = v.block_bytes
    assert block_bytes is not None
    try:
        fd = open_regular(name, os.O_RDONLY, dir_fd=shard_fd)
        try:
            st = os.fstat(fd)
            # As a tier's reader: share-locked and still at its name, or a live engine is recycling
            # it (rewriting it in place for another key) and it is gone (ValueVanished), not corrupt.
            hold_at_name(shard_fd, name, fd, st)
            payload = memoryview(b"")  # a size the manifest does not give fails before it is used
            if st.st_size in (PAYLOAD_OFFSET + block_bytes, entry_bytes(block_bytes)):
                if v.buf is None:
                    v.buf = bytearray(block_bytes)
                payload = memoryview(v.buf)
            try:
                read_value(fd, st.st_size, v.header, payload, namespace=v.digest, key=key,
                           block_bytes=block_bytes, direct=False, name=str(path))  # fmt: skip
            except CorruptValueError:
                own = _own_block_bytes(fd, st.st_size, key, v.digest)
                if own is None or own == block_bytes:
                    raise
                v.kept.append(CorruptEntry(str(path), (
                    f"size {st.st_size}, the manifest's block_bytes says {block_bytes}, but its own header "
                    f"({own} payload bytes) and checksum verify (kept: the manifest is suspect)")))  # fmt: skip
                return
        finally:
            os.close(fd)
        v.verified += 1
    except ForeignFormatError as exc:  # another release's value: not corrupt, never removed
        v.corrupt.append(CorruptEntry(str(path), f"{exc} (kept: not proven corrupt)"))
    except CorruptValueError as exc:
        v.corrupt.append(CorruptEntry(str(path), str(exc)))
        # Moved aside under a name no reader looks for, deleted only if it is still the file that failed.
        aside = f".{name}.inspect-{secrets.token_hex(4)}"
        if v.remove_corrupt and discard_corrupt(shard_fd, name, st, shard_fd, aside, v.modes):
            v.removed += 1
    except UnsafeEntryError as exc:
        v.entries -= 1
        v.unsafe.append(CorruptEntry(str(path), exc.reason))
    except FileNotFoundError:
        v.entries -= 1
    except OSError as exc:  # not checked (EIO, a mode that keeps this user out): kept, not proven corrupt
        v.unreadable.append(CorruptEntry(str(path), f"read failed ({exc.strerror or exc}): kept, not checked"))


_OWN_CHECK_CHUNK = 1 << 20
"""Bytes hashed at a time when a value is judged by its own header (:func:`_own_block_bytes`)."""


def _own_block_bytes(fd: int, size: int, key: bytes, digest: bytes) -> int | None:
    """The payload length of the value open as ``fd`` (``size`` bytes) if its own header (magic,
    version, namespace, key) and payload checksum verify and its size is one a value of that
    length has; else None. Hashes the payload a chunk at a time (no buffer of its size)."""
    try:
        header = decode_header(os.pread(fd, HEADER_SIZE, 0), namespace=digest, key=key)
    except (CorruptValueError, ForeignFormatError):
        return None
    n = header.payload_len
    if n <= 0 or size not in (PAYLOAD_OFFSET + n, entry_bytes(n)):
        return None
    hasher = payload_hasher()
    done = 0
    while done < n:
        chunk = os.pread(fd, min(_OWN_CHECK_CHUNK, n - done), PAYLOAD_OFFSET + done)
        if not chunk:
            return None
        hasher.update(chunk)
        done += len(chunk)
    return n if hasher.intdigest() == header.checksum else None


def _model_id(manifest: dict[str, Any] | None) -> Any:
    """The manifest's ``namespace.model_id``, None where the manifest does not have one as planned."""
    ns = (manifest or {}).get("namespace")
    return ns.get("model_id") if isinstance(ns, dict) else None


def _layout_problem(manifest: dict[str, Any]) -> str | None:
    """Why this release's fs tier refuses a manifest for its layout or value format (as
    :func:`ensure_manifest` compares them: another release's namespace), or None if it takes it
    (its own format, or an older one it reads and rewrites)."""
    value_format = manifest.get("value_format_version")
    if value_format != FORMAT_VERSION and not older_readable_format(value_format):
        return (f"manifest says value_format_version={value_format!r:.40}, this release reads "
                f"{FORMAT_VERSION}: another release's namespace, its engines refuse it")  # fmt: skip
    for entry, expected in (("kvtier_fs_layout", LAYOUT_VERSION), ("payload_offset", PAYLOAD_OFFSET)):
        if manifest.get(entry) != expected:
            return (f"manifest says {entry}={manifest.get(entry)!r:.40}, this release reads {expected}: "
                    "another release's namespace, its engines refuse it")  # fmt: skip
    return None


def _opened_name(given: Path, dir_fd: int) -> str:
    """The name to check the directory open as ``dir_fd`` under, given as ``given``: the given name
    when it is a namespace's (a link so named to a renamed directory checks as before), else the
    directory's own (for ``.``, ``..`` or a link named otherwise), when the resolved path still
    names the directory opened."""
    if _NAMESPACE_RE.fullmatch(given.name):
        return given.name
    real = os.path.realpath(given)
    try:
        st, held = os.stat(real), os.fstat(dir_fd)
    except OSError:
        return given.name
    return os.path.basename(real) if (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino) else given.name


def _verify_namespace(ns_fd: int, ns_dir: Path, check_payloads: bool, remove_corrupt: bool,
                      own_name: str | None = None) -> NamespaceReport:
    """Report on the namespace directory open as ``ns_fd`` (shown as ``ns_dir``; its own name
    ``own_name``, by default ``ns_dir``'s), through descriptors."""
    own_name = ns_dir.name if own_name is None else own_name
    manifest: dict[str, Any] | None = None
    manifest_error: str | None = None
    try:
        manifest = read_manifest(ns_fd)
        if manifest.get("namespace_digest") != own_name:
            manifest_error = f"manifest names namespace {manifest.get('namespace_digest')!r}, directory is {own_name}"
        elif not isinstance(manifest.get("namespace"), dict):
            manifest_error = "manifest field 'namespace' is not an object"
        else:
            manifest_error = _layout_problem(manifest)
    except (OSError, ValueError, UnsafeEntryError) as exc:
        manifest_error = f"unreadable manifest: {exc}"
    block_bytes = manifest.get("block_bytes") if manifest else None
    usable = manifest_error is None and type(block_bytes) is int and block_bytes > 0
    if manifest_error is None and not usable:
        manifest_error = f"manifest field 'block_bytes' is not a positive integer: {block_bytes!r:.40}"
    digest = bytes.fromhex(own_name) if _NAMESPACE_RE.fullmatch(own_name) else b""
    v = _Verification(digest, block_bytes if usable else None, check_payloads, remove_corrupt)
    for shard in SHARDS:
        _verify_shard(ns_fd, ns_dir, shard, v)
    v.unsafe += _unsafe_in_tmp(ns_fd, ns_dir)
    if v.kept and manifest_error is None:  # values that verify by themselves at another size
        manifest_error = (f"{len(v.kept)} value(s) verify by their own header at a size other than the manifest's "
                          f"block_bytes ({block_bytes}): the manifest is suspect (the values were kept)")  # fmt: skip
    live = stale = 0
    for state in temp_dirs(ns_fd, ns_dir):
        if state.live:
            live += state.files
        else:
            stale += state.files
    for name in sorted(e.name for e in os.scandir(ns_fd)):
        if name not in SHARDS and name not in (MANIFEST, STORE_ID, TMP_DIR, LEDGER_DIR, JOURNAL_DIR):
            v.foreign.append(str(ns_dir / name))
    problem = _store_id_problem(ns_fd)
    if problem is not None:  # reported, never removed (nor by remove_corrupt: not a value)
        v.unsafe.append(CorruptEntry(str(ns_dir / STORE_ID), problem))
    return NamespaceReport(
        digest=own_name,
        path=str(ns_dir),
        manifest=manifest,
        manifest_error=manifest_error,
        entries=v.entries,
        bytes=v.total,
        verified=v.verified,
        corrupt=v.corrupt,
        removed_corrupt=v.removed,
        foreign_files=v.foreign,
        unsafe_entries=v.unsafe,
        temp_files_live=live,
        temp_files_stale=stale,
        unreadable=v.unreadable,
        kept=v.kept,
    )
