"""The real-bytes bench driver, run small."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.interrupts import Terminated, raising_interrupts
from kvtier.keys import chain_ids
from kvtier.metrics import KvtierMetrics
from kvtier.tiers.base import HealthState, TierHealth
from kvtier.workload.bench import BenchOptions, BlockContent, TierUnreachableError, TierWatch, run_bench
from kvtier.workload.chat import ChatWorkloadSpec

SMALL = ChatWorkloadSpec(
    sessions=16, min_turns=2, max_turns=4, system_tokens=(128, 384), user_tokens=(16, 64), answer_tokens=(16, 96)
)


def small_options(shm: Path, **overrides: object) -> BenchOptions:
    base: dict[str, object] = {
        "shm_dir": str(shm),
        "workload": SMALL,
        "model": "tiny",
        "tokens_per_block": 16,  # 16 KiB blocks
        "cpu_bytes": 2 * 2**20,  # 128 blocks: smaller than the working set
        "device_blocks": 96,
        "prefill_tokens_per_s": 200_000.0,  # paces stores so the fs tier keeps up
    }
    base.update(overrides)
    return BenchOptions(**base)  # type: ignore[arg-type]


def test_block_content_detects_wrong_bytes() -> None:
    content = BlockContent(4096)
    a, b = chain_ids([1, 2])
    row = np.empty(4096, dtype=np.uint8)
    content.fill(a, row)
    assert content.matches(a, row)
    assert not content.matches(b, row)  # another block's bytes
    row[4000] ^= 1
    assert not content.matches(a, row)  # one flipped bit
    content.fill(a, row)
    assert not content.matches(a, np.roll(row, 8))  # shifted copy


def test_simulated_device_pool_is_page_aligned_and_resident() -> None:
    """Regression: numpy's 16-byte offset made the bench's loads (CPU -> device) 1.8x slower than stores."""
    from kvtier.workload.device import DevicePool

    pool = DevicePool(8, 16384)
    assert pool.data.ctypes.data % 4096 == 0 and pool.data.shape == (8, 16384)
    assert not pool.data.any()


def test_bench_moves_and_verifies_real_bytes_through_every_tier(tmp_path: Path, private_shm: Path) -> None:
    metrics = KvtierMetrics()
    progress: list[tuple[int, int]] = []
    result = run_bench(
        small_options(private_shm, fs_root=str(tmp_path / "fs")),
        progress=lambda done, total: progress.append((done, total)),
        metrics=metrics,
    )
    data = result.to_dict()
    assert result.errors == 0, data["errors"]
    assert result.requests == len({r["req_id"] for r in data["timeline"]}) > 10
    assert result.hits["device"] > 0 and result.hits["cpu"] > 0 and result.hits["fs"] > 0
    # Every block that came back from the CPU tier (incl. fs promotions) was checked.
    assert result.blocks_verified == result.hits["cpu"] + result.hits["fs"]
    assert sum(result.hits.values()) + result.computed_blocks == result.block_refs
    assert data["bytes"]["device_to_cpu"] > 0 and data["bytes"]["cpu_to_fs"] > 0 and data["bytes"]["fs_to_cpu"] > 0
    assert data["prefill_tokens_saved"] == sum(result.hits.values()) * 16
    assert data["latency"]["lookup_p50_us"] > 0 and len(result.step_ns) > 0
    assert progress[-1][0] == progress[-1][1] == result.requests
    assert b'kvtier_bytes_total{direction="write",tier="1:fs"}' in metrics.render()
    # The fs tier kept its files: a second run over the same root starts warm.
    warm = run_bench(small_options(private_shm, fs_root=str(tmp_path / "fs"), device_blocks=80))
    assert warm.errors == 0
    first_turns = [r for r in warm.timeline if r.req_id.endswith("-t0")]
    assert sum(r.tier_hits["fs"] for r in first_turns) > 0


def test_bench_without_secondary_tiers(private_shm: Path) -> None:
    result = run_bench(small_options(private_shm, fs=False, cpu_bytes=16 * 2**20))
    assert result.errors == 0
    assert result.tiers == ["cpu"]
    assert result.hits["cpu"] > 0
    assert result.blocks_verified == result.hits["cpu"]


def test_device_pool_too_small_is_explained(private_shm: Path) -> None:
    with pytest.raises(ConfigError, match="raise --device-blocks"):
        run_bench(small_options(private_shm, device_blocks=4, fs=False))


def test_same_seed_same_workload_shape(private_shm: Path) -> None:
    a = run_bench(small_options(private_shm, fs=False))
    b = run_bench(small_options(private_shm, fs=False))
    assert a.block_refs == b.block_refs and a.prompt_tokens == b.prompt_tokens
    # Scheduling order depends on copy timing; the set of requests does not.
    assert sorted(r.req_id for r in a.timeline) == sorted(r.req_id for r in b.timeline)


class _FlakyTier:
    """A collaborator of TierWatch: a tier whose health and drop counter the test sets."""

    def __init__(self) -> None:
        from kvtier.tiers.base import TierStats

        self.stats = TierStats()
        self.state = HealthState.CLOSED

    def health(self) -> TierHealth:
        return TierHealth(self.state, detail="refused" if self.state is HealthState.OPEN else "")


def test_tier_watch_labels_dropped_stores_by_their_cause() -> None:
    tier = _FlakyTier()
    watch = TierWatch("redis")
    tier.stats.stores_dropped = 3  # queue full while serving
    tier.stats.extra["stores_shed_queue_full"] = 3
    assert watch.sample(tier) is False  # type: ignore[arg-type]
    tier.state = HealthState.OPEN
    tier.stats.stores_dropped = 10
    assert watch.sample(tier) is True  # type: ignore[arg-type]  # just went out of service
    assert watch.sample(tier) is False  # type: ignore[arg-type]  # announced once
    tier.state = HealthState.HALF_OPEN
    tier.stats.stores_dropped = 12  # dropped while it was still out at the previous sample
    watch.sample(tier)  # type: ignore[arg-type]
    tier.stats.stores_dropped = 20  # 8 in service: 6 shed with the queue full, 2 found no room
    tier.stats.extra["stores_shed_queue_full"] = 9
    watch.sample(tier)  # type: ignore[arg-type]
    # (regression, 2026-12-06, review: the 2 that found no room were reported as "queue full")
    assert (watch.dropped_queue_full, watch.dropped_no_room, watch.dropped_out_of_service) == (3 + 6, 2, 7 + 2)
    assert watch.unreachable and watch.steps_out_of_service == 2 and watch.detail == "refused"
    assert watch.to_dict()["state_at_end"] == "half_open"


def test_an_unreachable_tier_is_announced_or_with_strict_refused(private_shm: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"  # closed before the bench connects
    said: list[str] = []
    result = run_bench(small_options(private_shm, fs=False, redis_url=url), notify=said.append)
    assert result.errors == 0 and result.unreachable_tiers == ["redis"]
    assert len(said) == 1 and "tier 1:redis is unreachable: circuit breaker open" in said[0]
    with pytest.raises(TierUnreachableError, match="--strict"):
        run_bench(small_options(private_shm, fs=False, redis_url=url, strict=True))


@pytest.mark.parametrize(
    ("field", "value"), [("batch_size", 0), ("device_blocks", -1), ("prefill_tokens_per_s", -1.0),
                         ("stall_timeout_s", 0.0), ("batch_size", True)]
)
def test_bench_options_refuse_values_no_run_can_use(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        BenchOptions(**{field: value})  # type: ignore[arg-type]


def test_the_console_line_never_shows_credentials() -> None:
    from kvtier.workload.bench import describe_options

    line = describe_options(BenchOptions(redis_url="redis://user:hunter2@10.0.0.1:6379/0", fs_root="/data/kv"))
    assert "hunter2" not in line and "redis redis://10.0.0.1:6379/0" in line and "fs /data/kv" in line


def _signalled_after(make: Any, *, before: bool = False) -> Any:
    """``make`` wrapped to send this process SIGTERM once it has built its object (before the caller
    holds it), or with ``before`` as it starts."""

    def build(*args: Any, **kwargs: Any) -> Any:
        if before:
            os.kill(os.getpid(), signal.SIGTERM)
        made = make(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return made

    return build


@pytest.mark.parametrize("step", ["temporary directory", "manager", "copy engine", "mid-run", "shutdown too"])
def test_a_signal_at_any_step_of_a_bench_releases_everything(
    tmp_path: Path, private_shm: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """Regression (2026-12-05, found by CI): SIGTERM landing while the run's state was being built (its
    copy engine starting, after it took a view of the CPU rows but before it was assigned) left that
    half-built object alive in the traceback: the region refused to close ("still has 1 exported
    view(s)") and the command exited 2 instead of 143. Landing between the temporary directory's
    creation and its owner's ``try`` left the directory behind. Every acquiring step now registers its
    release before the signal is raised (kvtier.interrupts); a second signal during the releases
    does not cut them."""
    import kvtier.workload.bench as bench

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    progress = None
    if step == "temporary directory":
        monkeypatch.setattr(bench, "LockedTempDir", _signalled_after(bench.LockedTempDir))
    elif step == "manager":
        monkeypatch.setattr(bench, "build_manager", _signalled_after(bench.build_manager))
    elif step == "copy engine":
        monkeypatch.setattr(bench, "TransferEngine", _signalled_after(bench.TransferEngine))
    else:
        steps = itertools.count()

        def progress(done: int, total: int) -> None:
            if next(steps) == 3:
                os.kill(os.getpid(), signal.SIGTERM)

        if step == "shutdown too":
            shutdown = _signalled_after(bench.TieringManager.shutdown, before=True)
            monkeypatch.setattr(bench.TieringManager, "shutdown", shutdown)
    before = {t.ident for t in threading.enumerate()}
    with raising_interrupts(), pytest.raises(Terminated) as caught:
        run_bench(small_options(private_shm, temp_dir=str(scratch)), progress=progress)
    assert caught.value.signum == signal.SIGTERM
    assert list(scratch.iterdir()) == [], "the bench's temporary directory was left behind"
    assert list(private_shm.iterdir()) == [], "the bench's region was left behind"
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    for thread in left:
        thread.join(10)
    assert not [t.name for t in left if t.is_alive()], "the bench left threads running"


def test_an_interrupt_inside_the_runs_construction_for_a_library_caller_releases_everything(
    tmp_path: Path, private_shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (2026-12-06, review): kvtier used as a library (Python's own Ctrl-C handler, no
    deferral in force), a KeyboardInterrupt landing while the run's state was built left the
    half-built object (a view of the CPU rows, a running copy thread) in the traceback: the
    caller got RegionBusyError instead of its KeyboardInterrupt, and the thread ran on."""
    import kvtier.workload.bench as bench

    built = bench._Run.__init__

    def interrupted(self: Any, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench._Run, "__init__", interrupted)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(KeyboardInterrupt) as caught:
        run_bench(small_options(private_shm, temp_dir=str(scratch)))
    assert type(caught.value) is KeyboardInterrupt
    assert list(scratch.iterdir()) == [] and list(private_shm.iterdir()) == []
    left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    for thread in left:
        thread.join(10)
    assert not [t.name for t in left if t.is_alive()], "the bench left threads running"
