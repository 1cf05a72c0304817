"""kvtier.workload.synthetic.generate (docs/policies.md: "Generation is deterministic per seed
(kvtier.workload.synthetic.generate)") refuses what is no count or seed with a ConfigError, never hangs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.workload.synthetic import generate

MAX_REQUESTS = 10_000_000  # as docs/policies.md's --requests and kvtier.workload.synthetic.MAX_REQUESTS


@pytest.mark.parametrize("requests", ["5.5", "MAX_REQUESTS + 1", "10**12"])
def test_a_count_that_is_no_whole_number_or_too_large_is_refused_not_generated_at_length(requests: str) -> None:
    """generate("chat", 5.5) never ended (its loop waits for len(out) == 5.5) while its memory grew, and
    10**12 requests ran for hours: run apart, so a regression fails on the timeout instead of hanging
    the suite or taking its memory."""
    code = (
        f"MAX_REQUESTS = {MAX_REQUESTS}\n"
        "from kvtier.workload.synthetic import generate\n"
        f"try:\n    generate('chat', {requests})\nexcept ValueError as exc:\n    print('refused:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    assert "refused: requests must be" in done.stdout, done.stdout


@pytest.mark.parametrize("requests", [True, "5", 2.0])
def test_counts_that_are_not_whole_numbers_are_config_errors(requests: object) -> None:
    with pytest.raises(ConfigError, match="requests must be"):
        generate("chat", requests)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 1.5, True])
def test_seeds_that_are_not_whole_numbers_from_zero_are_config_errors(seed: object) -> None:
    """A negative seed was numpy's bare ValueError 'expected non-negative integer'."""
    with pytest.raises(ConfigError, match="seed must be a whole number >= 0"):
        generate("chat", 10, seed)  # type: ignore[arg-type]


def test_numpy_integers_are_counts_and_seeds() -> None:
    assert generate("chat", np.int64(3), np.int64(2)) == generate("chat", 3, 2)
