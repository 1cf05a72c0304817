"""Files a user names: inputs only from regular files, capped and UTF-8 checked; outputs written in place.

Every case plants the real thing (a FIFO, a link to /dev/zero, a character
device, a symlink, a file on a full device) and checks what is read or written,
that the error names the path and the fix, and that no descriptor or temporary
file is left behind.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.user_files import OutputFile, check_output, open_input, read_text, write_output

# --------------------------------------------------------------------------- inputs


def _planted(tmp_path: Path) -> dict[str, Path]:
    """One of each thing a user could name instead of a regular file."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    null = tmp_path / "null.yaml"
    null.symlink_to("/dev/null")
    directory = tmp_path / "dir.yaml"
    directory.mkdir()
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop.name)
    return {"a FIFO": fifo, "a character device": zero, "a character device ": null, "a directory": directory,
            "symbolic link loop": loop, "no such file": tmp_path / "missing.yaml"}  # fmt: skip


@pytest.mark.parametrize("reader", ["read_text", "open_input"])
def test_only_regular_files_are_read_and_nothing_blocks(
    tmp_path: Path, reader: str, open_fds: Callable[[Path], list[str]]
) -> None:
    """Regression: a FIFO hung `config show`; a link to /dev/zero read until MemoryError."""
    for kind, path in _planted(tmp_path).items():
        done: list[BaseException] = []

        def attempt(path: Path = path, done: list[BaseException] = done) -> None:
            try:
                if reader == "read_text":
                    read_text(path, "config file")
                else:
                    os.close(open_input(path, "trace"))
            except BaseException as exc:
                done.append(exc)

        thread = threading.Thread(target=attempt, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), f"reading {kind} blocked"
        (error,) = done
        assert isinstance(error, ConfigError), error
        assert repr(str(path)) in str(error) and kind.strip() in str(error), str(error)
    assert open_fds(tmp_path) == []


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "real.yaml").write_text("policy: lru\n")
    (tmp_path / "link.yaml").symlink_to("real.yaml")
    assert read_text(tmp_path / "link.yaml", "config file") == "policy: lru\n"


@pytest.mark.parametrize("size", [1024 + 1, 10 * 1024])
def test_a_file_above_the_cap_is_refused_naming_it(tmp_path: Path, size: int) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * size)
    with pytest.raises(ConfigError, match=r"'.*big.yaml' is larger than 1.0 KiB"):
        read_text(path, "config file", max_bytes=1024)
    assert read_text(path, "config file", max_bytes=size) == "#" * size


@pytest.mark.parametrize(
    ("data", "offset", "line", "column"),
    [
        (b"\xff", 0, 1, 1),
        (b"policy: lru\n\xfe", 12, 2, 1),
        (b"a: 1\nb: 2\nmodel: caf\xe9\n", 20, 3, 11),
        (b"x" * 100 + b"\xc3", 100, 1, 101),  # a truncated multi-byte sequence at the end
        ("model: \u00e9\n".encode("latin-1"), 7, 1, 8),
    ],
)
def test_text_that_is_not_utf8_names_file_offset_line_and_column(
    tmp_path: Path, data: bytes, offset: int, line: int, column: int
) -> None:
    """Regression: UnicodeDecodeError tracebacks from config show, bench, sweep, sweep-shm and replay."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        read_text(path, "config file")
    text = str(err.value)
    assert f"'{path}' is not UTF-8" in text and f"at offset {offset} (line {line}, column {column})" in text, text


# --------------------------------------------------------------------------- outputs


def test_a_symlink_is_written_through_and_the_inode_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "target.json"
    target.write_text("old content that is longer than the new one\n")
    target.chmod(0o640)
    (tmp_path / "link.json").symlink_to("target.json")
    (tmp_path / "hard.json").hardlink_to(target)
    inode = target.stat().st_ino
    write_output(str(tmp_path / "link.json"), "new\n", "--json")
    assert (tmp_path / "link.json").is_symlink(), "the symlink was replaced"
    assert target.read_text() == "new\n" and target.stat().st_ino == inode
    assert (tmp_path / "hard.json").read_text() == "new\n", "the hard link was broken"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hard.json", "link.json", "target.json"]


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    (tmp_path / "link.json").symlink_to("new.json")
    check_output(str(tmp_path / "link.json"), "--json")
    write_output(str(tmp_path / "link.json"), b"{}", "--json")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "new.json").read_bytes() == b"{}"
    (tmp_path / "far.json").symlink_to(tmp_path / "missing" / "x.json")
    with pytest.raises(ConfigError, match=r"directory '.*missing' does not exist"):
        check_output(str(tmp_path / "far.json"), "--json")


def test_a_fifo_with_a_reader_is_written_to_one_without_is_refused_before_the_work(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="is a FIFO that no process is reading: start the reader first"):
        OutputFile(str(fifo), "--json")
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    for _ in range(200):  # the reader's open() is what lets a writer in
        try:
            out = OutputFile(str(fifo), "--json")
            break
        except ConfigError:
            threading.Event().wait(0.01)
    with out:
        threading.Event().wait(0.1)
        assert reader.is_alive(), "the reader saw the end of the file before anything was written"
        out.write('{"ok": true}\n')
    reader.join(timeout=10)
    assert received == [b'{"ok": true}\n'] and fifo.exists() and stat.S_ISFIFO(fifo.stat().st_mode)


def test_character_devices_are_written_to_and_never_replaced(tmp_path: Path) -> None:
    """Regression: `--json /dev/null` renamed a temp file over /dev/null (as root, that replaces the device)."""
    before = os.stat("/dev/null")
    write_output("/dev/null", "{}\n", "--json")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev
    assert not list(Path("/dev").glob("null.tmp-*"))
    with pytest.raises(ConfigError) as err:
        write_output("/dev/full", b"x" * 100, "--json")
    assert "'/dev/full' could not be written (No space left on device: free space" in str(err.value)
    assert "[Errno" not in str(err.value)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: p.mkdir(), "is a directory: give a file name"),
        (lambda p: None, None),  # a new file: fine
        (lambda p: p.write_text("x"), None),  # an existing file: fine
    ],
)
def test_what_is_at_the_output_path_is_checked_before_the_work(
    tmp_path: Path, make: Callable[[Path], None], fragment: str | None
) -> None:
    path = tmp_path / "out.json"
    make(path)
    if fragment is None:
        check_output(str(path), "--json")
    else:
        with pytest.raises(ConfigError, match=fragment):
            check_output(str(path), "--json")


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("x" * 256 + ".json", "has a name of 261 bytes, longer than the 255"),
        ("/".join(["d" * 200] * 25) + "/o.json", "bytes long, longer than the 4096 a path may have here"),
        ("missing/out.json", "directory '.*missing' does not exist"),
        ("", "--json is an empty path"),
    ],
)
def test_bad_output_names_are_refused_naming_flag_and_fix(tmp_path: Path, name: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        check_output(str(tmp_path / name) if name else "", "--json")


def test_an_output_may_not_be_the_file_read(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("{}\n")
    (tmp_path / "alias.jsonl").symlink_to(trace)
    with pytest.raises(ConfigError, match="is the file this command reads"):
        check_output(str(tmp_path / "alias.jsonl"), "--json", inputs=[str(trace)])


@pytest.mark.skipif(os.getuid() == 0, reason="root may write anywhere")
def test_an_unwritable_directory_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(ConfigError, match="is not writable"):
        check_output(str(locked / "o.json"), "--json")


_FAILING_WRITE = """
import resource, signal, sys
from kvtier.errors import ConfigError
from kvtier.user_files import write_output
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    write_output(sys.argv[1], b"x" * 100_000, "--json")
except ConfigError as exc:
    print(exc)
"""


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_write_names_the_path_and_leaves_no_temp_file(tmp_path: Path, existing: bool) -> None:
    """A write that fails half-way (here: past the file-size limit) leaves no ``*.tmp-*`` file and no new file."""
    target = tmp_path / "out.json"
    if existing:
        target.write_text("previous")
    out = subprocess.run([sys.executable, "-c", _FAILING_WRITE, str(target)], capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    message = out.stdout.strip()
    assert f"--json '{target}' could not be written (File too large" in message, message
    assert "[Errno" not in message
    if existing:
        assert "what is there is now incomplete" in message and target.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    else:
        assert "nothing was left there" in message
        assert not any(tmp_path.iterdir())


def test_yaml_merge_keys_merge_and_a_key_named_twice_is_still_refused(tmp_path: Path) -> None:
    """Regression (review, 2026-12-05): a standard merge key (``<<: *base``) was refused as "not valid
    YAML: could not determine a constructor for the tag 'tag:yaml.org,2002:merge'"."""
    from kvtier.config import load_config

    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers:\n  - &fs {type: fs, root: /a, read_threads: 2}\n  - {<<: *fs, root: /b}\n"
                    "backpressure: {<<: {high_seconds: 2.0}, low_seconds: 1.0}\n")  # fmt: skip
    config = load_config(path, env={})
    assert [(t["root"], t["read_threads"]) for t in config.tiers] == [("/a", 2), ("/b", 2)]
    assert config.backpressure.high_seconds == 2.0 and config.backpressure.low_seconds == 1.0
    path.write_text("backpressure: {<<: {high_seconds: 2.0}, low_seconds: 1.0, low_seconds: 0.5}\n")
    with pytest.raises(ConfigError, match="twice"):
        load_config(path, env={})
