"""The fleet tests use the test servers of ``tests/tiers`` (redis-server, moto)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiers"))
