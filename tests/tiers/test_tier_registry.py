"""The tier registry: one path validates every tier spec (built-in, registered, import path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.config import build_manager, load_config, render_config_reference
from kvtier.errors import ConfigError
from kvtier.tiers.registry import (
    builtin_tier_names,
    register_tier,
    resolve_tier_class,
    validate_tier_options,
)

PLUGIN = textwrap.dedent(
    '''
    """An out-of-tree tier, as a third-party package would write it."""
    from typing import Any, ClassVar

    from pydantic import BaseModel, ConfigDict, Field

    from kvtier.tiers.base import JobResult, SecondaryTier, TierContext, TierUsage, TransferJob
    from kvtier.types import LookupResult
    from kvtier.units import parse_size

    BUILT: list["NoteTier"] = []


    class NoteOptions(BaseModel):
        """A tier that only remembers which keys it was given."""

        model_config = ConfigDict(extra="forbid")
        label: str = Field(description="A name for logs.")
        capacity: int = Field(default=10, gt=0, description="Blocks it may note.")


    class NoteTier(SecondaryTier):
        tier_type: ClassVar[str] = "note"
        options_model = NoteOptions

        def __init__(self, context: TierContext, *, label: str, capacity: int = 10) -> None:
            super().__init__(context)
            self.label_text = label
            self.capacity = capacity
            self.results: list[JobResult] = []
            BUILT.append(self)

        def lookup(self, key: Any, request: Any) -> LookupResult:
            return LookupResult.MISS

        def submit_store(self, job: TransferJob) -> None:
            self.results.append(JobResult(job.job_id, True))

        def submit_load(self, job: TransferJob) -> None:
            self.results.append(JobResult(job.job_id, False))

        def poll_finished(self) -> list[JobResult]:
            out, self.results = self.results, []
            return out

        def usage(self) -> TierUsage:
            return TierUsage(0, self.capacity)

        def drain(self, timeout: float | None = None) -> None:
            pass

        def shutdown(self) -> None:
            pass


    class PlainTier(NoteTier):
        """No options model: its constructor's keywords are the schema."""

        options_model = None

        def __init__(self, context: TierContext, *, label: str, capacity: int = 10) -> None:
            super().__init__(context, label=label, capacity=capacity)
    '''
)


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A package outside kvtier on sys.path; returns its module name."""
    (tmp_path / "plug").mkdir()
    (tmp_path / "plug" / "kvtier_note_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path / "plug"))
    return "kvtier_note_plugin"


def test_registered_out_of_tree_tier_validates_and_builds_from_a_config_file(
    plugin: str, tmp_path: Path, private_shm: Path
) -> None:
    register_tier("note", f"{plugin}:NoteTier")
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(f"model: tiny\nnum_cpu_blocks: 4\nshm_dir: {private_shm}\ntiers:\n  - type: note\n    label: x\n")
    config = load_config(cfg, env={})
    assert config.tiers == [{"type": "note", "label": "x"}]  # given options only; the class keeps its defaults
    manager = build_manager(config)
    try:
        (tier,) = manager.tiers
        assert type(tier).__name__ == "NoteTier" and tier.label_text == "x" and tier.capacity == 10  # type: ignore[attr-defined]
    finally:
        manager.shutdown()
    # The same class by import path, with a bad option: refused when the file loads, with the close match.
    cfg.write_text(f"model: tiny\ntiers:\n  - type: '{plugin}:NoteTier'\n    label: x\n    capacty: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env={})
    message = str(err.value)
    assert "tiers[0]" in message and "'capacty'" in message and "did you mean 'capacity'" in message
    cfg.write_text("model: tiny\ntiers:\n  - type: note\n    label: x\n    capacity: 0\n")
    with pytest.raises(ConfigError, match=r"option 'capacity'.*greater than 0"):
        load_config(cfg, env={})


def test_out_of_tree_tier_in_a_config_file_from_the_command_line(plugin: str, tmp_path: Path) -> None:
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"model": "tiny", "tiers": [{"type": f"{plugin}:NoteTier", "label": "a"}]}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(tmp_path / "plug")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "config", "show", "--config", str(cfg), "--json"],
        capture_output=True, text=True, env=env, check=False, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["config"]["tiers"] == [{"type": f"{plugin}:NoteTier", "label": "a"}]
    cfg.write_text(json.dumps({"model": "tiny", "tiers": [{"type": f"{plugin}:NoteTier"}]}))
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "config", "show", "--config", str(cfg)],
        capture_output=True, text=True, env=env, check=False, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "option 'label': Field required" in out.stderr and "Traceback" not in out.stderr


def test_a_tier_without_a_model_is_checked_against_its_constructor(plugin: str) -> None:
    path = f"{plugin}:PlainTier"
    assert validate_tier_options({"type": path, "label": "a"}) == {"label": "a"}
    with pytest.raises(ConfigError, match=r"'labl' \(did you mean 'label'\?\)"):
        validate_tier_options({"type": path, "labl": "a"})
    with pytest.raises(ConfigError, match=r"missing required option\(s\) \['label'\]"):
        validate_tier_options({"type": path})


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ([1], "must be a mapping"),
        ({"root": "/x"}, "needs a 'type'"),
        ({"type": "nfs"}, "unknown tier type 'nfs'"),
        ({"type": "os:path"}, "does not name a SecondaryTier subclass"),
        ({"type": "fs", "root": "/x", "max_bytes": "much"}, "option 'max_bytes'"),
        ({"type": "fs", "root": "/x", "direct_io": "sometimes"}, "option 'direct_io'"),
    ],
)
def test_bad_specs_are_refused_with_where_and_why(spec: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_tier_options(spec, where="tiers[3]")
    assert str(err.value).startswith("tiers[3]") and fragment in str(err.value), str(err.value)


def test_options_are_converted_by_the_model() -> None:
    options = validate_tier_options({"type": "fs", "root": Path("/x"), "max_bytes": "2GiB"})
    assert options == {"root": "/x", "max_bytes": 2 * 2**30}


def test_reference_documents_every_builtin_tier_option() -> None:
    text = render_config_reference()
    for name in builtin_tier_names():
        model = resolve_tier_class(name).options_model
        assert model is not None
        assert f"## Tier `{name}`" in text
        for field in model.model_fields:
            assert f"| `{field}` |" in text


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("fs", "built-in tier"),
        ("memory", "built-in tier"),
        ("0:primary", "without ':'"),
        ("my tier", "without ':' or whitespace"),
        ("", "non-empty"),
        (7, "non-empty string"),
        # regression (2026-12-06, review): a selector word, which no request could select the tier by
        ("cpu", "a word of the per-request tier selectors"),
        ("Local", "a word of the per-request tier selectors"),
        ("all", "a word of the per-request tier selectors"),
    ],
)
def test_register_tier_refuses_names_that_would_replace_or_confuse_a_tier(name: object, fragment: str) -> None:
    """Regression (review, 2026-12-03): ``register_tier("fs", ...)`` silently replaced the built-in
    fs tier process-wide, and a name with ':' made labels like ``1:0:primary``."""
    with pytest.raises(ConfigError, match=fragment):
        register_tier(name, "package.module:Class")  # type: ignore[arg-type]
    assert resolve_tier_class("fs").__name__ == "FilesystemTier"
