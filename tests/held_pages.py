"""What keeps files below a directory open, mapped or named in this process: the proof that a
test gave back a tmpfs file's pages (``statvfs`` of /dev/shm cannot say it while other tests'
workers use it)."""

from __future__ import annotations

import os
from pathlib import Path


def open_fds_under(path: Path) -> list[str]:
    """What this process has open below ``path`` (from /proc/self/fd): must be empty after a cleanup."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            out.append(target)
    return out


def mappings_under(path: Path) -> list[str]:
    """This process's mappings of files below ``path`` (from /proc/self/maps, unlinked ones too)."""
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if f" {path}/" in line]


def pages_held_under(path: Path) -> list[str]:
    """What keeps pages of files below ``path`` (a tmpfs directory) allocated by this process: its
    descriptors and its mappings of them, linked or not, and the names still there. Empty means
    every page is given back (a tmpfs file's pages go with its last name, descriptor and mapping).
    The tmpfs's own usage (``statvfs``) cannot say it: other tests' workers use /dev/shm meanwhile."""
    return [*open_fds_under(path), *mappings_under(path), *(str(p) for p in path.iterdir())]
