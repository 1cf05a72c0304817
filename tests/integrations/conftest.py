"""Fixtures for the vLLM end-to-end tests: a locally built tiny model, prompts, a baseline run.

Every vLLM test module calls ``pytest.importorskip("vllm")`` first, so without
vLLM (the default dev venv) they are skipped with a clear reason.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.integrations.vllm.testing import random_prompt_ids

PROMPT_LENGTHS = (300, 337, 410)


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    return [random_prompt_ids(n, seed=i) for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Llama built in a temp dir for this test session (~5 s)."""
    from kvtier.integrations.vllm.testing import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private tmpfs directory for the region, so leak checks see only this test's files."""
    path = Path(tempfile.mkdtemp(prefix="kvt-vllm-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
