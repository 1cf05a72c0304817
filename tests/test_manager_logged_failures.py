"""A failure the manager logs never keeps the CPU rows mapped (issue 20, class 2, in the manager).

A handler that keeps log records (``logging.handlers.MemoryHandler``, pytest's capture, a log
shipper) keeps whatever a record holds. A record with ``exc_info`` holds the traceback, its
frames and their locals: a tier's frame that raised while holding a view of the CPU rows keeps
that view, and the shared region cannot be unmapped (``shutdown()`` raises ``RegionBusyError``;
after a failed ``create()`` the memory stays mapped). The manager logs every failure of a tier
(a scheduler-side call, a refused job, a failed ``shutdown()``, a failed cleanup after a failed
construction) as text, traceback included, and clears the exception's frames.
"""

from __future__ import annotations

import gc
import logging
import logging.handlers
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier import Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.errors import ConfigError, TierShutdownError
from kvtier.testing.conformance import keeping_every_record
from kvtier.tiers.registry import register_tier
from tier_doubles import ScriptedTier

pytestmark = pytest.mark.usefixtures("shm_leak_check")


class _RowHolding(ScriptedTier):
    """A tier whose chosen calls raise from a frame that holds a view of the CPU rows."""

    tier_type = "row-holding"

    def __init__(self, context: Any, fail: tuple[str, ...] = (), **options: Any) -> None:
        super().__init__(context, **options)
        self.fail = set(fail)

    def _maybe_raise(self, call: str) -> None:
        if call in self.fail:
            row = self.context.rows[0]  # a view of the CPU rows, a local of the raising frame
            raise RuntimeError(f"{call} failed while reading a row of {row.nbytes} bytes")

    def lookup(self, key: bytes, request: RequestContext | None) -> Any:
        self._maybe_raise("lookup")
        return super().lookup(key, request)

    def submit_load(self, job: Any) -> None:
        self._maybe_raise("submit_load")
        super().submit_load(job)

    def shutdown(self) -> None:
        super().shutdown()
        self._maybe_raise("shutdown")


class _Unbuildable(ScriptedTier):
    tier_type = "unbuildable"

    def __init__(self, context: Any, **options: Any) -> None:
        raise ConfigError("this tier cannot be built")


register_tier("row-holding", f"{__name__}:_RowHolding")
register_tier("unbuildable", f"{__name__}:_Unbuildable")


@pytest.fixture
def kept() -> Iterator[logging.handlers.MemoryHandler]:
    """A handler that keeps every record (it never flushes); on exit no record may hold an
    exception object (the conformance suite's check)."""
    with keeping_every_record() as handler:
        yield handler


def _manager(namespace: Namespace, shm: Path, *fail: str) -> TieringManager:
    return TieringManager.create(namespace=namespace, num_cpu_blocks=4, shm_dir=shm,
                                 tiers=[{"type": "row-holding", "fail": list(fail)}])  # fmt: skip


def _logged(handler: logging.handlers.MemoryHandler, text: str) -> list[logging.LogRecord]:
    return [r for r in handler.buffer if text in r.getMessage()]


@pytest.mark.parametrize("call", ["lookup", "submit_load"])
def test_a_failed_scheduler_call_logged_and_kept_pins_no_row(
    namespace: Namespace, private_shm: Path, kept: logging.handlers.MemoryHandler, call: str
) -> None:
    mgr = _manager(namespace, private_shm, call)
    (tier,) = mgr.tiers
    key = prefix_keys(np.arange(4), 4)[0]
    assert isinstance(tier, _RowHolding)
    tier.data[key] = b"v" * mgr.block_bytes
    mgr.lookup(key, RequestContext("r"))
    mgr.on_schedule_end()
    gc.collect()
    mgr.shutdown()  # RegionBusyError if a kept record still held the raising frame's view
    assert mgr.region.closed and not list(private_shm.iterdir())
    (record,) = _logged(kept, f"{call} failed while reading a row")
    assert record.exc_info is None and "Traceback" in record.getMessage() and "#1" in record.getMessage()


def test_a_failed_tier_shutdown_logged_and_kept_pins_no_row(
    namespace: Namespace, private_shm: Path, kept: logging.handlers.MemoryHandler
) -> None:
    mgr = _manager(namespace, private_shm, "shutdown")
    (tier,) = mgr.tiers
    assert isinstance(tier, _RowHolding)
    try:
        mgr.shutdown()
    except TierShutdownError as exc:
        error = exc.errors[0]
        assert exc.__cause__ is error and error.__traceback__ is not None, "the caller still sees where it failed"
    else:
        raise AssertionError("shutdown() did not report the tier's failure")
    del error
    tier.fail.clear()
    gc.collect()
    mgr.shutdown()  # RegionBusyError if a kept record still held the raising frame's view
    assert mgr.region.closed and not list(private_shm.iterdir())
    (record,) = _logged(kept, "Failed to shut down secondary tier #1 (type=row-holding, class=_RowHolding)")
    assert record.exc_info is None and "shutdown failed while reading a row" in record.getMessage()


def test_a_failed_cleanup_after_a_failed_create_logged_and_kept_pins_no_row(
    namespace: Namespace, private_shm: Path, kept: logging.handlers.MemoryHandler
) -> None:
    """A tier that fails to shut down keeps its view of the rows while it lives (it may still use
    them): the path is unlinked at once, the memory returned once nothing holds the tier. A kept
    record must not be what holds it."""
    tiers = [{"type": "row-holding", "fail": ["shutdown"]}, {"type": "unbuildable"}]
    with pytest.raises(ConfigError, match="cannot be built") as info:
        TieringManager.create(namespace=namespace, num_cpu_blocks=4, shm_dir=private_shm, tiers=tiers)
    assert info.value.__traceback__ is not None, "the caller still sees where create() failed"
    del info
    gc.collect()
    mapped = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(private_shm) in line]
    assert mapped == [], "the region is still mapped: a kept record holds the failed tier"
    (record,) = _logged(kept, "cleanup after failed construction: secondary tier #1")
    assert record.exc_info is None and "shutdown failed while reading a row" in record.getMessage()


class _UnprintableError(Exception):
    def __str__(self) -> str:
        raise ValueError("str() of this error fails")


class _UnprintablyFailing(ScriptedTier):
    """A tier whose lookup() and usage() raise an exception that cannot be made text."""

    tier_type = "unprintably-failing"

    def lookup(self, key: bytes, request: RequestContext | None) -> Any:
        raise _UnprintableError()

    def usage(self) -> Any:
        raise _UnprintableError()


register_tier("unprintably-failing", f"{__name__}:_UnprintablyFailing")


def test_a_tier_error_that_cannot_be_made_text_is_still_contained(
    namespace: Namespace, private_shm: Path, kept: logging.handlers.MemoryHandler
) -> None:
    """Regression (review, 2026-12-05): the report of the error raised str()'s ValueError out of
    lookup() and stats() (both promise a misbehaving tier costs its answer, never the call)."""
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=4, shm_dir=private_shm,
                                tiers=[{"type": "unprintably-failing"}])  # fmt: skip
    key = prefix_keys(np.arange(4), 4)[0]
    assert mgr.lookup(key, RequestContext("r")).name == "MISS"
    tier_stats = mgr.stats().tiers[1]
    assert tier_stats.capacity_bytes is None
    mgr.shutdown()
    for call in ("lookup", "usage"):
        (record,) = _logged(kept, f"raised from {call}()")
        assert "_UnprintableError: <unprintable _UnprintableError>" in record.getMessage()
