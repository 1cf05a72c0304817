"""The TieringManager's life (create, shutdown) with real tiers: defects an outside audit found."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tier_doubles
from kvtier import KVGeometry, LookupResult, Namespace, RequestContext, TieringManager
from kvtier.errors import ConfigError, ManagerClosedError, RegionError
from kvtier.tiers.registry import register_tier

register_tier("scripted", "tier_doubles:ScriptedTier")
NS = Namespace("lifecycle-audit", KVGeometry.from_block_bytes(8192))


@pytest.fixture(autouse=True)
def _clear_calls() -> Iterator[None]:
    tier_doubles.CALLS.clear()
    yield
    tier_doubles.CALLS.clear()


def _fs_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvtier-fs-1-")]


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-deadline", "deadline"])
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_in_one_tiers_cleanup_after_a_failed_create_still_shuts_the_other_tiers_down(
    private_shm: Path, tmp_path: Path, interrupt: type[BaseException], timeout: float | None
) -> None:
    """A failed create shuts down every tier it built: nothing could retry it later (the caller
    gets no manager). A KeyboardInterrupt/SystemExit from one tier's shutdown used to stop the
    cleanup there: the tiers built before it kept running (a real fs tier's threads, for the
    life of the process) and the region's path stayed linked. The interrupt is still raised and
    the mapping kept (the interrupted tier may still use the rows)."""
    assert not _fs_threads()
    specs = [
        {"type": "fs", "root": str(tmp_path / "fs")},
        {"type": "scripted", "name": "t2"},
        {"type": "scripted", "name": "t3", "shutdown_error": interrupt()},
        {"type": "scripted", "name": "t4", "construct_error": ConfigError("tier 4 cannot start")},
    ]
    with pytest.raises(interrupt) as info:
        TieringManager.create(namespace=NS, num_cpu_blocks=4, tiers=specs, shm_dir=private_shm,
                              expected_mappers=2, shutdown_timeout=timeout)  # fmt: skip
    assert isinstance(info.value.__context__, ConfigError)  # the original error stays reachable
    assert tier_doubles.CALLS == [("t3", "shutdown"), ("t2", "shutdown")]
    assert not _fs_threads(), "the fs tier built before the interrupted one was never shut down"
    assert not list(private_shm.iterdir()), "the region's path must not outlive the failed create"


@pytest.fixture
def shutdown_on_sigusr1() -> Iterator[list[TieringManager]]:
    """A SIGUSR1 handler that shuts down the manager put in the list it yields (as an engine's
    handler of SIGTERM does), on the scheduler thread, between two bytecodes of whatever it runs."""
    managers: list[TieringManager] = []
    previous = signal.signal(signal.SIGUSR1, lambda *_: managers[0].shutdown())
    try:
        yield managers
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("call", ["submit_store", "submit_load"])
def test_a_shutdown_by_a_signal_handler_inside_a_tier_submit_leaves_the_interrupted_call_clean(
    private_shm: Path, tmp_path: Path, shutdown_on_sigusr1: list[TieringManager], call: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A signal handler that shuts the manager down while the scheduler thread is inside a real fs
    tier's submit_store/submit_load (a cascade of complete_store, the promotions of
    on_schedule_end): the tier then refuses the job (it is shut down). The interrupted call used
    to fail with a bare ``KeyError: <job id>`` (the job had been cleared by the shutdown) after
    logging the refusal as an error; it now returns, and the next call says the manager is closed."""
    mgr = TieringManager.create(namespace=NS, num_cpu_blocks=8, shm_dir=private_shm,
                                tiers=[{"type": "fs", "root": str(tmp_path / "fs")}])  # fmt: skip
    shutdown_on_sigusr1.append(mgr)
    key, req = b"k" * 32, RequestContext("r")
    mgr.on_new_request(req)
    stored = mgr.prepare_store([key], req)
    assert stored is not None
    tier = mgr.tiers[0]
    real = getattr(tier, call)

    def submit_with_signal(job: Any) -> None:
        signal.raise_signal(signal.SIGUSR1)  # the handler runs here, before the tier's own code
        real(job)

    if call == "submit_load":
        mgr.complete_store(stored.keys_to_store, req)
        mgr.reset_cache()  # waits for the cascade; the fs tier keeps the block, the CPU tier drops it
        assert mgr.lookup(key, req) is LookupResult.HIT_PENDING
    setattr(tier, call, submit_with_signal)
    with caplog.at_level(logging.ERROR, logger="kvtier"):
        if call == "submit_store":
            mgr.complete_store(stored.keys_to_store, req)
        else:
            mgr.on_schedule_end()
    assert mgr.is_shut_down and mgr.region.closed
    assert not [r for r in caplog.records if "failed to accept" in r.getMessage()]
    with pytest.raises(ManagerClosedError):
        mgr.on_schedule_end()


@pytest.mark.parametrize("shm_dir", ["", 5, None, b"/dev/shm"], ids=["empty", "int", "none", "bytes"])
def test_a_bad_shm_dir_is_refused_by_name_and_makes_nothing(
    shm_dir: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shm_dir=""`` used to put the region in the current directory (any file system, not the
    tmpfs asked for), and a non-path (None, a number) failed with a bare TypeError naming no
    argument; each is now a RegionError naming ``shm_dir``, before anything is made."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RegionError, match="shm_dir must be a directory path"):
        TieringManager.create(namespace=NS, num_cpu_blocks=2, shm_dir=shm_dir)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())
