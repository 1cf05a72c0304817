"""benchmarks/chaos.py stays honest: a short run of it passes (the full run is on the docs' Operations page)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

CHAOS = Path(__file__).resolve().parents[1] / "benchmarks" / "chaos.py"


@pytest.mark.slow
def test_a_short_chaos_run_finds_no_hang_no_wrong_byte_and_no_leak() -> None:
    out = subprocess.run([sys.executable, str(CHAOS), "--trials", "4", "--seed", "3"],
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    figures = dict(re.findall(r"^  ([a-z ]+?)\s{2,}(\d+)", out.stdout, flags=re.M))
    for metric in ("trials", "hangs", "wrong bytes served", "split mappings", "files left behind", "valid values lost"):
        assert metric in figures, out.stdout
        assert figures[metric] == ("4" if metric == "trials" else "0"), out.stdout
