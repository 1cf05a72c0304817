"""The cascade admission seam (kvtier.manager.admission): a tier's handle asks its admission once
per cascade job, and tells it about every cascade job the tier reports."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvtier import Namespace, RequestContext, TieringManager, prefix_keys
from kvtier.keys import BlockKey
from kvtier.manager.admission import BackpressureAdmission, CascadeAdmission
from kvtier.telemetry import BackpressureSnapshot
from kvtier.tiers.base import JobResult
from kvtier.tiers.registry import register_tier
from tier_doubles import ScriptedTier

pytestmark = pytest.mark.usefixtures("shm_leak_check")
register_tier("scripted", "tier_doubles:ScriptedTier")


class OnlyRequest:
    """Admits the cascades of one request; records what it was asked and told."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self.asked: list[tuple[list[BlockKey], str | None, int]] = []
        self.finished_jobs: list[tuple[JobResult, float]] = []
        self.served_keys: list[BlockKey] = []

    def admit(self, keys: Sequence[BlockKey], request: RequestContext | None, stores_in_flight: int) -> bool:
        self.asked.append((list(keys), None if request is None else request.req_id, stores_in_flight))
        return request is not None and request.req_id == self.req_id

    def finished(self, result: JobResult, seconds: float) -> None:
        self.finished_jobs.append((result, seconds))

    def served(self, keys: Sequence[BlockKey]) -> None:
        self.served_keys.extend(keys)

    def touched(self, keys: Sequence[BlockKey]) -> None:
        pass

    def snapshot(self) -> BackpressureSnapshot | None:
        return None


def test_an_admission_decides_per_cascade_job_and_hears_each_finished_one(namespace: Namespace) -> None:
    tiers = [{"type": "scripted", "name": "a"}, {"type": "scripted", "name": "b"}]
    mgr = TieringManager.create(namespace=namespace, num_cpu_blocks=8, tiers=tiers)
    try:
        admission = OnlyRequest("yes")
        seam: CascadeAdmission = admission  # what a learned admission will implement (issue 21)
        # Until a tier's options can name its admission, the seam is reached through its handle.
        mgr._tiers.handles[0].admission = seam
        a, b = mgr.tiers
        assert isinstance(a, ScriptedTier) and isinstance(b, ScriptedTier)
        stored: dict[str, list[bytes]] = {}
        for req_id, seed in (("yes", 0), ("no", 1)):
            request = RequestContext(req_id)
            keys = prefix_keys(np.arange(12) + 1000 * seed, 4)
            result = mgr.prepare_store(keys, request)
            assert result is not None
            mgr.complete_store(result.keys_to_store, request)
            mgr.on_schedule_end()
            stored[req_id] = keys
        mgr.on_schedule_end()  # the tiers' last reports are polled
        assert [(asked[1], len(asked[0])) for asked in admission.asked] == [("yes", 3), ("no", 3)]
        assert set(a.data) == set(stored["yes"]), "the refused job never reached the tier"
        assert set(b.data) == set(stored["yes"] + stored["no"]), "another tier's admission is its own"
        snap = mgr.stats()
        assert snap.manager.cascades_skipped == 3
        assert snap.tier("1:scripted").backpressure is None, "the snapshot shows the admission's own state"
        assert snap.tier("2:scripted").backpressure is not None, "the default admission is backpressure"
        ((result, seconds),) = admission.finished_jobs
        assert result.success and seconds >= 0 and set(result.successful_keys or ()) == set(stored["yes"])
        assert mgr.primary.pinned_count() == 0, "a skipped cascade keeps no CPU row pinned"
    finally:
        mgr.shutdown()


def test_backpressure_samples_only_jobs_that_reached_the_medium() -> None:
    from kvtier.backpressure import BackpressureSettings, StoreLatencyMonitor

    monitor = StoreLatencyMonitor(BackpressureSettings(warmup_jobs=1), "1:fs")
    admission = BackpressureAdmission(monitor)
    admission.finished(JobResult(1, True, bytes_moved=0), 9.0)  # the tier held the keys: no I/O
    admission.finished(JobResult(2, False, seconds=0.0), 9.0)  # shed at once
    assert monitor.samples == 0
    admission.finished(JobResult(3, True, bytes_moved=4096), 2.0)
    admission.finished(JobResult(4, False, seconds=1.5), 1.5)  # failed after time on the medium
    assert monitor.samples == 2 and monitor.active
    assert not admission.admit([b"k" * 32], None, stores_in_flight=1)
    assert admission.admit([b"k" * 32], None, stores_in_flight=0), "one probe when nothing is in flight"
