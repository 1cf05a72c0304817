"""A threaded tier whose constructor fails part way through starting its threads joins the ones
that started and re-raises: nothing keeps running in an engine whose tier never came up.

Each built-in threaded tier is built with ``threading.Thread.start`` failing on its Nth call (N
from 1 to the tier's thread count), against a server that is not there (the tiers start their
threads before they talk to it).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from s3_servers import FAST_FAILURE, free_port, s3_options

from kvtier.testing import make_namespace
from kvtier.tiers.base import TierContext
from kvtier.tiers.registry import create_tier


class ThreadStartRefused(RuntimeError):
    """What the patched ``Thread.start`` raises (as ``can't start new thread`` would)."""


def _options(kind: str, tmp_path: Path) -> dict[str, Any]:
    port = free_port()  # nothing listens there
    if kind == "fs":
        return {"type": "fs", "root": str(tmp_path / "root"), "read_threads": 2, "write_threads": 2}
    if kind == "redis":
        return {"type": "redis", "url": f"redis://127.0.0.1:{port}/0", "io_threads": 3}
    return {**s3_options(f"http://127.0.0.1:{port}", "no-bucket", **FAST_FAILURE), "max_in_flight": 4}


class StartControl:
    """``Thread.start`` patched for the test's own thread: counts its starts, and refuses the n-th
    start after :meth:`arm` (threads other threads start are left alone)."""

    def __init__(self) -> None:
        self.owner = threading.get_ident()
        self.started = 0
        self.left = 0

    def arm(self, n: int) -> None:
        self.started, self.left = 0, n


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> StartControl:
    control = StartControl()
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        if threading.get_ident() == control.owner:
            if control.left > 0:
                control.left -= 1
                if control.left == 0:
                    raise ThreadStartRefused(f"refused to start {self.name}")
            control.started += 1
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return control


def _tier_threads(kind: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"kvtier-{kind}-") and t.is_alive()]


@pytest.mark.parametrize("kind", ["fs", "redis", "s3"])
def test_a_tier_whose_thread_fails_to_start_joins_the_others_and_raises(
    kind: str, tmp_path: Path, starts: StartControl
) -> None:
    rows = np.zeros((4, 64), dtype=np.uint8)
    options = _options(kind, tmp_path)
    starts.arm(0)
    tier = create_tier(options, TierContext(rows, 64, make_namespace(64), index=1))
    started = starts.started  # every thread the tier starts when nothing fails
    tier.shutdown()
    assert started >= 3 and _tier_threads(kind) == []
    for n in range(1, started + 1):
        starts.arm(n)
        try:
            built = create_tier(options, TierContext(rows, 64, make_namespace(64), index=1))
        except ThreadStartRefused:
            pass
        else:
            built.shutdown()
            pytest.fail(f"start {n} of {started} was refused, yet the tier was built")
        starts.arm(0)
        assert _tier_threads(kind) == [], f"threads left running after start {n} of {started} failed"
