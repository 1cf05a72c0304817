"""Interrupt signals raised as exceptions in the main thread, and held back across deferred steps."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from kvtier.interrupts import DeferredReleases, Terminated, interrupts_deferred, raising_interrupts


def _signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)


@pytest.fixture(autouse=True)
def plain_handlers() -> Iterator[None]:
    """Python's own handlers while a test runs, whatever this pytest inherited (``pytest &`` from a
    script starts it with SIGINT ignored, ``nohup pytest`` with SIGHUP ignored)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@pytest.mark.parametrize(("sig", "kind"), [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated),
                                           (signal.SIGHUP, Terminated)])  # fmt: skip
def test_each_signal_raises_its_interrupt_at_once(sig: int, kind: type[BaseException]) -> None:
    with raising_interrupts(), pytest.raises(kind) as caught:
        _signal_self(sig)
        pytest.fail("the signal did not raise")
    assert type(caught.value) is kind
    assert getattr(caught.value, "signum", signal.SIGINT) == sig


def test_the_previous_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with raising_interrupts():
        assert all(signal.getsignal(sig) is not handler for sig, handler in before.items())
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_signal_inside_a_deferral_is_raised_when_the_outermost_one_exits() -> None:
    steps: list[str] = []
    with raising_interrupts():
        with pytest.raises(Terminated) as caught:
            with interrupts_deferred():
                with interrupts_deferred():
                    _signal_self(signal.SIGTERM)
                    steps.append("inner went on")
                steps.append("outer went on")
            steps.append("after the deferral")
        assert steps == ["inner went on", "outer went on"]
        assert caught.value.signum == signal.SIGTERM
        with interrupts_deferred():
            steps.append("nothing pending any more")  # the raised signal was forgotten: this exit raises nothing
    assert steps[-1] == "nothing pending any more"


def test_a_second_signal_while_one_is_held_back_raises_at_once() -> None:
    steps: list[str] = []
    with raising_interrupts(), pytest.raises(Terminated) as caught, interrupts_deferred():
        _signal_self(signal.SIGTERM)
        steps.append("held back")
        _signal_self(signal.SIGHUP)  # Ctrl-C again: the user means it (a release that hangs is abandoned)
        steps.append("went on after the second")
    assert steps == ["held back"] and caught.value.signum == signal.SIGHUP


def test_a_block_that_fails_inside_a_deferral_still_ends_interrupted() -> None:
    with raising_interrupts(), pytest.raises(KeyboardInterrupt) as caught, interrupts_deferred():
        _signal_self(signal.SIGINT)
        raise ValueError("the step failed")
    assert isinstance(caught.value.__context__, ValueError)


def test_deferred_releases_all_run_when_a_signal_lands_among_them() -> None:
    done: list[str] = []

    def release(name: str) -> None:
        if name == "second":
            _signal_self(signal.SIGTERM)
        done.append(name)

    with raising_interrupts(), pytest.raises(Terminated):
        with DeferredReleases() as releases:
            for name in ("third", "second", "first"):  # (run in reverse)
                releases.callback(release, name)
        pytest.fail("the signal was not raised after the releases")
    assert done == ["first", "second", "third"]


def test_a_signal_inherited_as_ignored_stays_ignored() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts a command
    try:
        with raising_interrupts():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            _signal_self(signal.SIGHUP)  # nothing raised
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_another_threads_deferral_holds_nothing_back_in_the_main_thread() -> None:
    inside = threading.Event()
    leave = threading.Event()

    def worker() -> None:
        with interrupts_deferred():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=worker)
    try:
        with raising_interrupts():
            thread.start()
            assert inside.wait(10)
            with pytest.raises(Terminated):
                _signal_self(signal.SIGTERM)
                pytest.fail("the signal was held back by another thread's deferral")
    finally:
        leave.set()
        thread.join(10)


def test_outside_the_main_thread_installing_changes_nothing() -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[object] = []

    def worker() -> None:
        with raising_interrupts():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert seen == [before]


def test_a_nested_install_keeps_the_signal_an_outer_deferral_holds_back() -> None:
    """Regression (2026-12-06, review): leaving a nested ``raising_interrupts`` (``kvtier.cli.main``
    called in-process under one) reset the deferral state: the held-back signal was lost and the
    depth went to -1, so later deferrals held nothing back."""
    with raising_interrupts():
        with pytest.raises(Terminated), interrupts_deferred():
            _signal_self(signal.SIGTERM)
            with raising_interrupts():
                pass
        steps: list[str] = []
        with pytest.raises(Terminated), interrupts_deferred():
            _signal_self(signal.SIGTERM)
            steps.append("held back")
        assert steps == ["held back"]


def test_a_signal_landing_while_the_handlers_go_back_reaches_the_handler_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression (2026-12-06, review): the handlers went back one at a time with kvtier's still on
    the others; a SIGTERM right after SIGINT's was put back raised out of the exit and left
    kvtier's handler on SIGTERM and SIGHUP for good. The signals are blocked meanwhile now."""
    import types

    import kvtier.interrupts as interrupts

    heard: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
    before = {sig: signal.getsignal(sig) for sig in interrupts.INTERRUPT_SIGNALS}
    real = signal.signal

    def put_back_then_signal(sig: int, handler: object) -> object:
        previous = real(sig, handler)  # type: ignore[arg-type]
        if sig == signal.SIGINT and handler is not interrupts._on_signal:  # the exit putting SIGINT's back
            _signal_self(signal.SIGTERM)
        return previous

    monkeypatch.setattr(interrupts, "signal", types.SimpleNamespace(**{**vars(signal), "signal": put_back_then_signal}))
    with raising_interrupts():
        pass
    assert heard == [signal.SIGTERM]
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_child_forked_inside_a_deferral_ends_on_sigterm() -> None:
    """Regression (2026-12-06, review): a child forked while the parent was inside a deferral kept
    the parent's deferral (which nothing in the child would end) and kvtier's handler: its SIGTERM
    (``Process.terminate()``) was held back for good. The child starts with neither."""
    with raising_interrupts(), interrupts_deferred():
        pid = os.fork()
        if pid == 0:  # the child: wait for a SIGTERM for at most 10 s
            try:
                _signal_self(signal.SIGTERM)
                threading.Event().wait(10)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, f"child ended with status {status:#x}"
