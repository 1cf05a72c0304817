"""A subscriber reconstructs, exactly, which blocks each engine holds in which tier, from the
engines' event streams alone: two engines (real TieringManagers, CPU tiers in /dev/shm) share
one fs root under a shared size bound (so each evicts the other's files), run a random
workload of stores and loads, and one restarts, one resets its CPU tier, one loses a batch
of events and is made whole by a snapshot. At every checkpoint the index's CPU sets equal
each engine's CPU tier and its fs set equals the value files on disk."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from fleet_helpers import Engine, disk_keys, fleet_key, prompt_keys

from kvtier.fleet import FleetIndex

pytestmark = pytest.mark.usefixtures("shm_leak_check")


def _prompts() -> list[list[bytes]]:
    prompts = []
    for i in range(14):
        blocks = 3 + i % 4
        prompts.append(prompt_keys(seed=100 + i, blocks=blocks, shared=min(2, blocks - 1) if i % 3 else 0,
                                   shared_seed=i % 2))  # fmt: skip
    return prompts


def _feed(index: FleetIndex, engines: list[Engine]) -> None:
    for engine in engines:
        batch = engine.take()
        if batch.events:
            index.apply(engine.name, batch)


def _check_exact(index: FleetIndex, engines: list[Engine], root: Path) -> None:
    """The index equals each engine's CPU tier and the files on disk. A peer's eviction reaches
    an engine through its journal reader (every ~0.1 s, on an I/O thread): under load that takes
    longer, so the shared-store part is compared until it matches or 10 s pass."""
    deadline = time.monotonic() + 10
    while True:
        for engine in engines:
            engine.settle()
        _feed(index, engines)
        on_disk = disk_keys(root)
        assert on_disk, "the workload should leave files in the shared root"
        if all(index.held(e.name, "1:fs") == on_disk for e in engines) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for engine in engines:
        state = index.engine(engine.name)
        assert state.start == engine.stream.start and state.private_complete, (state.start, state.status)
        assert index.held(engine.name, "0:primary") == engine.cpu_keys(), engine.name
        assert index.held(engine.name, "1:fs") == on_disk, engine.name


@pytest.mark.parametrize("seed", [1, 2])
def test_index_reconstructs_both_engines_exactly_across_restart_reset_and_loss(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    prompts = _prompts()
    root = tmp_path / "shared-root"
    a, b = Engine("a", root), Engine("b", root)
    engines = [a, b]
    # Snapshots count as 0.5 s older than they are: more than the fs root journal lag (~0.1 s),
    # the only lag between an engine index and the disk.
    index = FleetIndex(["a", "b"], lag_seconds=0.5)
    checks = 0
    try:
        for round_ in range(1, 121):
            engine = rng.choice(engines)
            prompt = rng.choice(prompts)
            if rng.random() < 0.35:
                engine.load(prompt)
            else:
                engine.store(prompt)
            _feed(index, engines)
            if round_ == 40:  # b restarts on the same root: its CPU tier is gone, the fs root is not
                old_start = b.stream.start
                b.shutdown()  # what its I/O threads did after its last take is never reported...
                time.sleep(0.6)  # ...and its next start (vLLM: tens of seconds later) announces the root
                b = Engine("b", root)
                engines[1] = b
                _feed(index, engines)
                assert index.engine("b").start != old_start and index.engine("b").restarts == 1
                assert index.held("b", "0:primary") == set()
            if round_ == 70:  # a resets its CPU tier
                a.stream.reset_cache()
                _feed(index, engines)
                assert index.held("a", "0:primary") == set() == a.cpu_keys()
            if round_ == 95:  # a batch of a's events is lost on the way
                a.store(prompts[0])
                a.settle()
                lost = a.take()
                assert lost.events
                a.store(prompts[1])
                a.stream.mark("after-loss")  # the next record shows the gap, whatever was stored
                _feed(index, engines)
                assert index.engine("a").status == "partial" and index.engine("a").gaps == 1
                assert list(index.engine("a").marks)[-1] == "after-loss"
                assert not index.engine("a").private_complete
                a.settle()
                b.settle()
                time.sleep(0.6)  # the lost batch changes are older than the lag window now
                assert a.stream.request_snapshot()
                _feed(index, engines)
                # The CPU tier is whole again; a device cache (none here) stays unknown until a clear.
                assert index.engine("a").private_complete and not index.engine("a").device_complete
            if round_ < 95:
                assert index.engine("a").status == index.engine("b").status == "synced"
            if round_ % 15 == 0:
                _check_exact(index, engines, root)
                checks += 1
        _check_exact(index, engines, root)
        assert checks == 8
        assert index.engine("a").unattributed == index.engine("b").unattributed == 0
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_snapshot_brings_back_the_s3_blocks_an_engine_lost_with_its_events(tmp_path: Path) -> None:
    """Added 2026-12-04: an S3 tier listed no holdings, so the blocks an engine stored there in
    events the index lost (more than the engine's replay buffer) stayed unknown to the fleet
    until stored again; an fs root's snapshot brought its blocks back. An S3 tier's snapshot
    now lists what its existence index answers HIT for."""
    from s3_servers import moto_available, s3_options, start_moto

    if not moto_available():
        pytest.skip("moto is not installed")
    moto = start_moto(tmp_path / "moto")
    try:
        a = Engine("a", tmp_path, tier=s3_options(moto.endpoint, moto.create_bucket()))
        index = FleetIndex(["a"], lag_seconds=0.1)
        try:
            _feed(index, [a])
            keys = prompt_keys(seed=7, blocks=5)
            a.store(keys)
            a.settle()
            assert a.take().events  # lost: the index never sees these stores
            a.stream.mark("after-loss")
            _feed(index, [a])
            assert index.engine("a").gaps == 1 and index.held("a", "1:s3") == set()
            assert a.stream.request_snapshot()
            while a.stream.has_pending_output():
                _feed(index, [a])
            assert index.held("a", "1:s3") == {fleet_key(k) for k in keys}
        finally:
            a.shutdown()
    finally:
        moto.stop()
