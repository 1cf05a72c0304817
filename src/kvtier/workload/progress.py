"""A progress display for long ``kvtier`` runs: requests done, rate and time left, on a terminal only.

:class:`RequestProgress` draws a rich progress bar on its console when that
console is a terminal and ``enabled`` is true; otherwise it draws nothing and
its lines (:meth:`RequestProgress.say`) go out as plain lines, so a piped or
redirected run prints no bar and no control characters. The bar is transient:
it is erased when the run ends, and the tables print after it.

Used from one thread (the caller's: the replay or bench loop), which calls
:meth:`RequestProgress.update` as work is done; rich's own refresh thread
redraws the bar and is joined when the ``with`` block ends.
"""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


class _RateColumn(ProgressColumn):
    """Requests per second, as rich estimates it over the last samples."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("-- req/s" if speed is None else f"{speed:,.0f} req/s")


class RequestProgress:
    """A transient bar ``description [####  ] done/total  N req/s  elapsed  ETA``, or nothing.

    ``console``: where the bar and :meth:`say` lines go (standard error in the CLI).
    ``total``: requests the whole run will handle (None: unknown, the bar pulses).
    ``enabled``: False (``--no-progress``) draws nothing even on a terminal.
    """

    def __init__(self, console: Console, total: int | None, *, description: str = "", enabled: bool = True) -> None:
        self.console = console
        self.shown = enabled and console.is_terminal
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._total = total
        self._description = description

    def __enter__(self) -> RequestProgress:
        if self.shown:
            columns = (
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                _RateColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self._bar = Progress(*columns, console=self.console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task(self._description, total=self._total)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(kind, exc, tb)
            self._bar = None

    def update(self, done: int, total: int | None = None, description: str | None = None) -> None:
        """``done`` requests so far (of ``total`` if it changed); ``description`` replaces the label."""
        if self._bar is None or self._task is None:
            return
        if total is not None:
            self._total = total
        self._bar.update(self._task, completed=done, total=self._total, description=description)

    def say(self, line: str) -> None:
        """One line above the bar (or just the line when no bar is shown): no markup, no highlighting."""
        self.console.print(line, soft_wrap=True, highlight=False, markup=False)
