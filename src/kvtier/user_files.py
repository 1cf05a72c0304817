"""Files a local user names on the command line or in a setting: inputs read safely, outputs written in place.

A user's own paths are trusted as *names* (a symlink they made is followed, as
the shell would), but not as *things*: what is at the path may be a FIFO that
never delivers a byte, a link to ``/dev/zero``, a file of gigabytes or of
Latin-1 text, a device. The rules:

* **Inputs** (config files, traces): only a regular file is opened for reading.
  The path is ``stat``-ed first (a FIFO or device is never opened), then opened
  with ``O_NONBLOCK | O_NOCTTY`` and the descriptor checked to be the same
  regular file. Reads are capped (:func:`read_text`'s ``max_bytes``; a trace
  counts decompressed bytes as it streams), and text that is not UTF-8 is an
  error naming the file, the byte offset, the line and the column.
* **Outputs** (``--json``, ``--plot``, ``--output``): ``-`` means standard
  output. :func:`check_output` runs before any work (missing or unwritable
  directory, a name too long, a directory, socket or block device at the path).
  :func:`write_output` never replaces what is at the path: a regular file is
  truncated and written in place (a symlink is written through to its target,
  as the shell's ``>`` does; permissions, owner and hard links stay), a FIFO
  with a reader or a character device (``/dev/null``, ``/dev/stdout``) is
  written to, a FIFO without a reader is refused at once (never waited on).
  The content is rendered before the file is opened, no temporary file is
  ever made, and a file this call created is removed again if writing it fails.

Every failure raises :class:`~kvtier.errors.ConfigError` naming what the path is
for (``"config file"``, ``"--json"``), the path as typed, what is wrong and the
fix. Plain functions; any thread; each does blocking file-system I/O.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import sys
from collections.abc import Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.units import format_size, shown
from kvtier.untrusted import kind_of

STDOUT = "-"
"""The output path that means standard output."""

MAX_CONFIG_BYTES = 1024**2
"""The largest configuration file read (1 MiB; a real one is a few hundred bytes)."""

_HINTS = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check its permissions or pick another path",
    errno.EPERM: "check its permissions or pick another path",
    errno.ENOSPC: "free space on that file system or pick another path",
    errno.EDQUOT: "free space (disk quota exceeded) or pick another path",
    errno.EROFS: "the file system is read-only: pick another path",
    errno.ENAMETOOLONG: "shorten the name",
    errno.ELOOP: "the path has a symbolic link loop: fix the links",
    errno.ENOTDIR: "a part of the path is not a directory: check the path",
    errno.EISDIR: "give a file, not a directory",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f): raise the limit or pick another path",
    errno.EIO: "the device reported an I/O error: check the disk",
    errno.EBADF: "run the command with its output open (not '>&-')",
}


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook`` for a user's JSON: an object that names a key twice is
    refused (ValueError naming the key) instead of keeping its last value unnoticed."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` of a user's YAML, refusing a mapping that names a key twice (a
    :class:`yaml.constructor.ConstructorError` naming the key and its line)."""
    import yaml

    return yaml.load(text, Loader=_unique_key_loader())  # a SafeLoader: nothing is evaluated


@functools.cache
def _unique_key_loader() -> type:
    """The SafeLoader subclass :func:`load_yaml` uses (made once: yaml is imported on first use)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: merged below, its keys overridable
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the base class says so
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"found the key {key!r} twice",
                        key_node.start_mark,
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def os_error_text(exc: OSError) -> str:
    """An OSError in words with its fix (``"No space left on device: free space on ..."``), no ``[Errno N]``."""
    reason = exc.strerror or str(exc)
    hint = _HINTS.get(exc.errno or 0)
    return f"{reason.rstrip('.')}: {hint}" if hint else reason


def _refuse(what: str, path: str, problem: str) -> ConfigError:
    return ConfigError(f"{what} {shown(path, 120)}{'' if problem.startswith(':') else ' '}{problem}")


# --------------------------------------------------------------------------- inputs


def open_input(path: str | os.PathLike[str], what: str) -> int:
    """A read-only descriptor of the regular file at ``path`` (symlinks followed); the caller closes it.

    Never opens a FIFO, socket or device and never blocks. Raises
    :class:`ConfigError` naming ``what``, the path and the fix.
    """
    name = os.fspath(path)
    if not name:
        raise ConfigError(f"{what} is an empty path: give a file name")
    try:
        before = os.stat(name)
    except FileNotFoundError:
        raise _refuse(what, name, "cannot be read: there is no such file: check the path") from None
    except OSError as exc:
        raise _refuse(what, name, f"cannot be read: {os_error_text(exc)}") from None
    _check_regular_input(before, what, name)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise _refuse(what, name, f"cannot be read: {os_error_text(exc)}") from None
    try:
        after = os.fstat(fd)
        _check_regular_input(after, what, name)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise _refuse(what, name, "changed while it was being opened: try again")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular_input(st: os.stat_result, what: str, name: str) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise _refuse(what, name, "is a directory: give a file")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(what, name, f"is {kind_of(st.st_mode)}, not a regular file: give a regular file")


def decode_utf8(data: bytes, what: str, path: str, *, start_offset: int = 0, line: int | None = None) -> str:
    """``data`` as UTF-8 text, or :class:`ConfigError` naming the file, the byte offset, line and column.

    ``start_offset`` is the file offset of ``data[0]``; ``line`` its line number
    (1-based) when ``data`` is one line, else the line is counted in ``data``.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.start
        before = data[:bad]
        at_line = line if line is not None else before.count(b"\n") + 1
        column = bad - (before.rfind(b"\n") + 1) + 1
        raise ConfigError(
            f"{what} {path!r} is not UTF-8: byte 0x{data[bad]:02x} at offset {start_offset + bad} "
            f"(line {at_line}, column {column}): save it as UTF-8"
        ) from None


def read_text(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """The whole UTF-8 text of the regular file at ``path``, at most ``max_bytes`` of it.

    Raises :class:`ConfigError` for anything but a regular file, a file larger
    than ``max_bytes``, text that is not UTF-8, or a read error.
    """
    name = os.fspath(path)
    fd = open_input(name, what)
    try:
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise _refuse(what, name, f"cannot be read: {os_error_text(exc)}") from None
    finally:
        os.close(fd)
    if total > max_bytes:
        raise _refuse(what, name, f"is larger than {format_size(max_bytes)}, the most kvtier reads: check the path")
    return decode_utf8(b"".join(chunks), what, name)


# --------------------------------------------------------------------------- outputs


def _name_too_long(path: str) -> str | None:
    """Why ``path`` cannot be a file name on this system (a component or the whole too long), or None."""
    encoded = os.fsencode(path)
    limit = 4096
    with contextlib.suppress(OSError, ValueError):
        limit = os.pathconf(os.path.dirname(os.path.abspath(path)) or "/", "PC_PATH_MAX")
    if len(encoded) >= limit:
        return f"is {len(encoded)} bytes long, longer than the {limit} a path may have here"
    for part in encoded.split(b"/"):
        name_max = 255
        if len(part) > name_max:
            return f"has a name of {len(part)} bytes, longer than the {name_max} a file name may have"
    return None


def check_output(path: str, flag: str, inputs: Sequence[str | os.PathLike[str] | None] = ()) -> None:
    """Refuse, before any work, an output path that cannot be written (exit 2 in the CLI).

    ``-`` (standard output) always passes. Refused: an empty path, a name too
    long, a missing or unwritable directory, a directory, socket or block device
    at the path, a path ending in a slash (a directory's name, never a file's), and
    the same file as one of ``inputs`` (the config or trace read).
    """
    if path == STDOUT:
        return
    if not path:
        raise ConfigError(f"{flag} is an empty path: give a file name, or '-' for standard output")
    too_long = _name_too_long(path)
    if too_long:
        raise _refuse(flag, path, f"{too_long}: shorten it")
    try:
        st: os.stat_result | None = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        st = None
    except OSError as exc:
        raise _refuse(flag, path, f"cannot be written: {os_error_text(exc)}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise _refuse(flag, path, "is a directory: give a file name")
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            raise _refuse(flag, path, f"is {kind_of(st.st_mode)}: give a file name, or '-' for standard output")
        if not os.access(path, os.W_OK):
            raise _refuse(flag, path, "is not writable: check its permissions or pick another path")
        for other in inputs:
            if other is not None and _same_file(st, other):
                raise _refuse(flag, path, "is the file this command reads: pick another path")
        return
    # Nothing there (or a dangling symlink, written through to its target): the directory must take a new file.
    if path.endswith((os.sep, os.altsep or os.sep)):  # realpath drops the slash; open() would fail after the work
        raise _refuse(flag, path, "ends with a slash, so it names a directory: give a file name")
    target = os.path.realpath(path)
    parent = os.path.dirname(target) or "."
    shown_parent = parent if os.path.islink(path) else os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        what = " (something else is there)" if os.path.lexists(parent) else ""
        raise _refuse(
            flag, path, f": directory {shown_parent!r} does not exist{what}: create it or pick another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _refuse(flag, path, f": directory {shown_parent!r} is not writable: pick another path")


def _same_file(st: os.stat_result, other: str | os.PathLike[str]) -> bool:
    try:
        o = os.stat(other)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (o.st_dev, o.st_ino) == (st.st_dev, st.st_ino)


def write_output(path: str, data: bytes | str, flag: str) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` in place, or to standard output for ``-``.

    See the module docstring for what is written to and what is refused. On a
    failed write, a file this call created is removed; a file that existed is
    left truncated and the message says so. Raises :class:`ConfigError`.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if path == STDOUT:
        sys.stdout.flush()
        sys.stdout.buffer.write(payload)
        sys.stdout.buffer.flush()
        return
    fd, created = _open_output(path, flag)
    _write_all(fd, payload, path, flag, created)


def _write_all(fd: int, payload: bytes, path: str, flag: str, created: str | None) -> None:
    """Write ``payload`` to ``fd`` (truncating a regular file first) and close it; ConfigError on failure."""
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            os.ftruncate(fd, 0)
        elif not (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            raise _refuse(flag, path, f"is {kind_of(st.st_mode)}: give a file name, or '-' for standard output")
        os.set_blocking(fd, True)  # a FIFO with a reader: wait for it to read, as any writer does
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as exc:
        os.close(fd)
        fd = -1
        if created is not None:
            _remove_quietly(created)
            left = "nothing was left there"
        else:
            left = "what is there is now incomplete"
        raise _refuse(flag, path, f"could not be written ({os_error_text(exc)}); {left}") from None
    finally:
        if fd >= 0:
            os.close(fd)


class OutputFile:
    """An output path checked before the work and written once after it (the CLI's ``--json`` and ``--plot``).

    The constructor runs :func:`check_output`. A FIFO or character device at
    the path is opened right away (without blocking: a FIFO nobody reads is
    refused before the work, and a reader waiting on it keeps a writer until
    :meth:`write`, so it never sees an early end of file); a regular or new file
    is only opened by :meth:`write`, so work that fails leaves nothing behind.
    :meth:`close` (or leaving the ``with`` block) releases an unused descriptor.
    One thread.
    """

    def __init__(self, path: str, flag: str, inputs: Sequence[str | os.PathLike[str] | None] = ()) -> None:
        check_output(path, flag, inputs)
        self.path = path
        self.flag = flag
        self._fd: int | None = None
        if path == STDOUT:
            return
        try:
            st = os.stat(path)
        except OSError:
            return
        if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
            self._fd, _ = _open_output(path, flag)

    def write(self, data: bytes | str) -> None:
        """Write ``data`` (once); raises :class:`ConfigError` naming the flag and the path on failure."""
        payload = data.encode("utf-8") if isinstance(data, str) else data
        fd, self._fd = self._fd, None
        if fd is None:
            write_output(self.path, payload, self.flag)
        else:
            _write_all(fd, payload, self.path, self.flag, None)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> OutputFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_output(path: str, flag: str) -> tuple[int, str | None]:
    """A write descriptor of ``path`` and the file this call created (to remove on failure), if it did.

    A new file is only ever made with ``O_EXCL``: at ``path``, or at the target
    of a dangling symlink there. What exists is opened as it is, without ``O_CREAT``.
    """
    base = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        try:
            return os.open(path, base | os.O_CREAT | os.O_EXCL, 0o666), path
        except FileExistsError:
            pass  # something is there (or a symlink): open it as it is
        try:
            return os.open(path, base), None
        except FileNotFoundError:
            target = os.path.realpath(path)  # a dangling symlink: write through it, creating its target
            return os.open(target, base | os.O_CREAT | os.O_EXCL, 0o666), target
    except FileNotFoundError:
        raise _refuse(flag, path, ": its directory does not exist: create it or pick another path") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise _refuse(flag, path, "is a FIFO that no process is reading: start the reader first") from None
        raise _refuse(flag, path, f"cannot be written: {os_error_text(exc)}") from None


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


__all__ = [
    "MAX_CONFIG_BYTES",
    "STDOUT",
    "OutputFile",
    "check_output",
    "decode_utf8",
    "load_yaml",
    "open_input",
    "os_error_text",
    "read_text",
    "unique_keys",
    "write_output",
]
