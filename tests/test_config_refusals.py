"""Values a configuration review (2026-12-06) found accepted and then misread, or refused late by
another part of the system than the one the user set: each refused where it is set, naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import kv_transfer_config
from kvtier.tiers.s3_inspect import options_from_url


def _refused(cli: dict[str, object]) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(env={}, cli=cli)
    return str(err.value)


@pytest.mark.parametrize("value", [True, False])
def test_kv_factor_as_a_boolean_is_refused(value: bool) -> None:
    # Regression: kv_factor: true was read as 1 (a latent cache): half the bytes, another namespace.
    message = _refused({"model": "tiny", "geometry": {"kv_factor": value}})
    assert "kv_factor must be a number" in message


def test_kv_factor_as_a_number_still_loads() -> None:
    config = load_config(env={}, cli={"model": "tiny", "geometry": {"kv_factor": 1}})
    assert config.kv_geometry().kv_factor == 1


@pytest.mark.parametrize("root", ["~/kvtier", "~", " ", "\t"])
def test_an_fs_root_that_no_shell_expands_is_refused(root: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # Regression: "~/kv" made the directory "./~/kv" under the engine's working directory.
    monkeypatch.chdir(tmp_path)
    message = _refused({"model": "tiny", "tiers": [{"type": "fs", "root": root}]})
    assert "option 'root'" in message and repr(root) in message
    assert list(tmp_path.iterdir()) == []


def test_two_fs_tiers_on_one_directory_are_refused(tmp_path: Path) -> None:
    # Regression: both tiers used one namespace directory under two budgets.
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    message = _refused({"model": "tiny", "tiers": [{"type": "fs", "root": str(tmp_path / "real")},
                                                    {"type": "fs", "root": f"{tmp_path}/link/"}]})  # fmt: skip
    assert "tiers[0] and tiers[1] are both fs tiers on" in message and str(tmp_path / "real") in message
    apart = [{"type": "fs", "root": str(tmp_path / "a")}, {"type": "fs", "root": str(tmp_path / "b")}]
    config = load_config(env={}, cli={"model": "tiny", "tiers": apart})
    assert len(config.tiers) == 2


def test_a_cpu_tier_beyond_the_row_limit_is_refused_naming_cpu_bytes() -> None:
    # Regression: accepted by the config, then refused by the manager's build as num_cpu_blocks.
    config = load_config(env={}, cli={"model": "tiny", "cpu_bytes": "1PiB"})
    words = r"cpu_bytes=1125899906842624 \(from CLI flag --cpu-bytes\) holds \d+ blocks, above"
    with pytest.raises(ConfigError, match=words):
        config.resolved_num_cpu_blocks()


def test_a_geometry_no_size_can_hold_says_so() -> None:
    geometry = {"num_layers": 65536, "num_kv_heads": 65536, "head_dim": 65536, "tokens_per_block": 65536,
                "dtype": "float32"}  # fmt: skip
    config = load_config(env={}, cli={"geometry": geometry})
    with pytest.raises(ConfigError, match="no size can hold one: check the geometry"):
        config.resolved_num_cpu_blocks()


def test_config_show_refuses_a_cpu_tier_beyond_the_row_limit() -> None:
    kvtier = Path(sys.executable).parent / "kvtier"
    run = subprocess.run([kvtier, "config", "show", "--model", "tiny", "--cpu-bytes", "1PiB"], capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2
    assert "above the CPU tier's limit" in run.stderr and "Traceback" not in run.stderr


def test_kv_transfer_config_checks_the_region_name_as_the_engine_does() -> None:
    # Regression: accepted here, refused by the engine at start (the engine id's digest follows it).
    assert kv_transfer_config(region_name="a" * 231)["kv_connector_extra_config"]["region_name"] == "a" * 231
    with pytest.raises(ConfigError, match=r"region_name .* is 232 bytes"):
        kv_transfer_config(region_name="a" * 232)


def test_an_s3_url_keeps_its_bucket_name_as_typed() -> None:
    # Regression: urlsplit lower-cased the bucket (another bucket, which --remove-corrupt could clean).
    assert options_from_url("s3://my-bucket/p") == {"bucket": "my-bucket", "prefix": "p"}
    assert options_from_url("s3://MyBucket/p")["bucket"] == "MyBucket"  # then refused as a bucket name
    with pytest.raises(ConfigError, match="takes no port"):
        options_from_url("s3://my-bucket:99/p")  # the port was dropped
