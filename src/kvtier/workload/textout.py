"""Consoles for the ``kvtier`` command's tables and lines, the same piped as on a terminal.

rich pads a table's title and caption (and justified lines) with spaces up to the
table's width. On a terminal that is invisible; in a pipe or a file it leaves
trailing spaces on many lines, which diff tools and tests trip over. A console
made here writes through :class:`TrailingSpaceStripper` whenever its stream is
not a terminal, so every line it writes ends in its last visible character.

A console made here also lets a closed pipe (``kvtier bench | head -1``) surface as
:class:`BrokenPipeError`, so the command stops the way every other ``kvtier`` command
does (exit 141, quietly); rich's own handling exits with status 1, the status that
means "the run found a problem".

No state outside the objects made; each console belongs to the thread that prints
with it (the CLI's main thread).
"""

from __future__ import annotations

import io
import sys
from typing import TextIO, cast

from rich.console import Console


class TrailingSpaceStripper(io.TextIOBase):
    """A text stream that drops the spaces and tabs that end each line, then writes to ``target``.

    Spaces are held back until it is known whether text follows them on the same line,
    so nothing but trailing whitespace is ever dropped (a write ending in ``"a  "``
    followed by one of ``"b\\n"`` gives ``"a  b\\n"``). Held spaces are dropped at
    :meth:`close`; :meth:`flush` writes everything else.
    """

    def __init__(self, target: TextIO) -> None:
        super().__init__()
        self._target = target
        self._held = ""

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        lines = (self._held + text).split("\n")
        last = lines.pop()
        out = "".join(line.rstrip(" \t") + "\n" for line in lines)
        kept = last.rstrip(" \t")
        self._held = last[len(kept) :]
        self._target.write(out + kept)
        return len(text)

    def flush(self) -> None:
        self._target.flush()

    def close(self) -> None:
        self._held = ""
        self.flush()
        super().close()


class PipeAwareConsole(Console):
    """A rich console that raises :class:`BrokenPipeError` when its reader has gone away.

    rich's :meth:`Console.on_broken_pipe` raises ``SystemExit(1)``; the ``kvtier``
    entry point turns a :class:`BrokenPipeError` into exit status 141 with nothing on
    standard error, the shell's convention for a writer stopped by SIGPIPE.
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is written through this console
        raise BrokenPipeError("the reader of this console's stream has gone away")


def text_console(*, stderr: bool = False, min_width: int | None = None) -> Console:
    """A rich console on standard output (or error) that leaves no trailing spaces when piped.

    ``min_width``: the width tables are laid out for when the stream is not a
    terminal (or the terminal is narrower), so a wide table is not folded in a pipe.
    """
    stream = sys.stderr if stderr else sys.stdout
    probe = Console(file=stream)
    width = probe.width if min_width is None else max(min_width, probe.width)
    if probe.is_terminal:
        return PipeAwareConsole(file=stream, width=width)
    return PipeAwareConsole(file=cast(TextIO, TrailingSpaceStripper(stream)), width=width)
