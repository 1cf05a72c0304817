"""Interrupt signals raised as exceptions in the main thread, and held back across deferred steps."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from kvtier.interrupts import Terminated, deferring_interrupts, interrupts_deferred, raising_interrupts


def _signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)


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
    with raising_interrupts(), pytest.raises(Terminated) as caught:
        with interrupts_deferred():
            with interrupts_deferred():
                _signal_self(signal.SIGTERM)
                steps.append("inner went on")
            steps.append("outer went on")
            _signal_self(signal.SIGHUP)  # a second signal adds nothing: the first one is raised
            steps.append("outer ended")
        steps.append("after the deferral")
    assert steps == ["inner went on", "outer went on", "outer ended"]
    assert caught.value.signum == signal.SIGTERM
    with raising_interrupts(), interrupts_deferred():
        steps.append("nothing pending any more")  # the raised signal was forgotten


def test_a_block_that_fails_inside_a_deferral_still_ends_interrupted() -> None:
    with raising_interrupts(), pytest.raises(KeyboardInterrupt) as caught, interrupts_deferred():
        _signal_self(signal.SIGINT)
        raise ValueError("the step failed")
    assert isinstance(caught.value.__context__, ValueError)


def test_a_wrapped_release_runs_whole() -> None:
    done: list[str] = []

    def release() -> str:
        _signal_self(signal.SIGTERM)
        done.append("released")
        return "result"

    with raising_interrupts(), pytest.raises(Terminated):
        deferring_interrupts(release)()
    assert done == ["released"]


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
