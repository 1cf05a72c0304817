"""The vLLM integration's pure parts: version pin, extra_config mapping and row layout.

No vLLM needed: these run in every venv.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvtier
from kvtier.errors import ConfigError
from kvtier.integrations.vllm import SPEC_MODULE_PATH, SPEC_NAME, kv_transfer_config
from kvtier.integrations.vllm.config import (
    EngineLayout,
    VllmVersionError,
    check_vllm_version,
    region_name_for,
    resolve_settings,
)
from kvtier.region import region_path

LAYOUT = EngineLayout(
    engine_id="0f1e2d3c-aaaa-bbbb-cccc-000000000001",
    model_name="/models/tiny",
    kv_dtype="float32",
    tokens_per_chunk=64,
    blocks_per_chunk=2,
    worker_kv_bytes_per_block=32768,
    world_size=2,
    layer_names=("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"),
)


def test_importing_kvtier_and_the_integration_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = (
        "import sys, kvtier, kvtier.integrations.vllm, kvtier.integrations.vllm.config, "
        "kvtier.integrations.vllm.copier; print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert kvtier.__name__ == "kvtier"


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.7.dev3"])
def test_supported_versions_pass(version: str) -> None:
    assert check_vllm_version(version)[:2] == (0, 32)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_versions_outside_the_pin_fail_with_the_range_and_the_fix(version: str) -> None:
    with pytest.raises(VllmVersionError, match=r">=0\.32\.0,<0\.33\.0.*" + version.replace(".", r"\.")):
        check_vllm_version(version)
    assert check_vllm_version(version, allow_untested=True)


def test_unparseable_version_is_a_clear_error() -> None:
    with pytest.raises(VllmVersionError, match="cannot parse"):
        check_vllm_version("banana")


def test_settings_size_rows_for_every_rank_and_count_every_mapper() -> None:
    s = resolve_settings({"cpu_bytes": "8MiB", "block_size": 64, "spec_name": SPEC_NAME}, LAYOUT, env={})
    assert s.layout.rank_bytes == 2 * 32768
    assert s.layout.row_bytes == 2 * 2 * 32768
    assert s.namespace.geometry is None  # rows are opaque bytes: the layout is in the namespace's extra
    assert dict(s.namespace.extra)["rank_bytes"] == str(s.layout.rank_bytes)
    assert s.num_rows == (8 << 20) // s.layout.row_bytes
    assert s.expected_mappers == 3  # two workers and the scheduler
    assert s.region_name == region_name_for(LAYOUT.engine_id)
    region_path(s.region_name)  # a valid region file name


def test_settings_are_deterministic_and_namespaced_by_engine_layout() -> None:
    a = resolve_settings({"num_cpu_blocks": 10}, LAYOUT, env={})
    b = resolve_settings({"num_cpu_blocks": 10}, LAYOUT, env={})
    assert (a.region_name, a.num_rows, a.namespace.digest) == (b.region_name, 10, b.namespace.digest)
    other_dtype = EngineLayout(**{**LAYOUT.__dict__, "kv_dtype": "bfloat16"})
    assert resolve_settings({"num_cpu_blocks": 10}, other_dtype, env={}).namespace.digest != a.namespace.digest
    other_engine = EngineLayout(**{**LAYOUT.__dict__, "engine_id": "another"})
    # Another engine instance of the same model shares tier data but not the region.
    c = resolve_settings({"num_cpu_blocks": 10}, other_engine, env={})
    assert c.namespace.digest == a.namespace.digest and c.region_name != a.region_name


def test_an_explicit_region_name_is_never_shared_by_two_engines() -> None:
    """Regression (review, 2026-12-03): two DP replicas share one ``kv_connector_extra_config``
    (only ``engine_id`` gets a ``_dp<rank>`` suffix); with an explicit ``region_name`` both engines
    mapped one region, so each loaded the other's KV and cascaded zeros into shared tiers."""
    dp0 = EngineLayout(**{**LAYOUT.__dict__, "engine_id": "engine_dp0"})
    dp1 = EngineLayout(**{**LAYOUT.__dict__, "engine_id": "engine_dp1"})
    a = resolve_settings({"num_cpu_blocks": 10, "region_name": "shared"}, dp0, env={})
    b = resolve_settings({"num_cpu_blocks": 10, "region_name": "shared"}, dp1, env={})
    assert a.region_name.startswith("shared-") and b.region_name.startswith("shared-")
    assert a.region_name != b.region_name
    assert resolve_settings({"num_cpu_blocks": 10, "region_name": "shared"}, dp0, env={}).region_name == a.region_name
    too_long = r"region_name \(from kv_connector_extra_config\['region_name'\]\) is 240 bytes.* at most 231"
    with pytest.raises(ConfigError, match=too_long):
        resolve_settings({"num_cpu_blocks": 10, "region_name": "r" * 240}, dp0, env={})
    with pytest.raises(ConfigError, match=r"region_name \(from environment variable KVTIER_REGION_NAME\)"):
        resolve_settings({"num_cpu_blocks": 10}, dp0, env={"KVTIER_REGION_NAME": "r" * 232})
    region_path(resolve_settings({"num_cpu_blocks": 10, "region_name": "r" * 231}, dp0, env={}).region_name)


def test_vllm_cpu_offloading_names_are_accepted_as_aliases() -> None:
    s = resolve_settings({"cpu_bytes_to_use": 1 << 22, "eviction_policy": "arc"}, LAYOUT, env={})
    assert s.config.cpu_bytes == 1 << 22 and s.config.policy == "arc"


def test_environment_applies_below_extra_config() -> None:
    s = resolve_settings({"policy": "lru"}, LAYOUT, env={"KVTIER_POLICY": "arc", "KVTIER_CPU_BYTES": "4MiB"})
    assert s.config.policy == "lru" and s.config.cpu_bytes == 4 << 20


@pytest.mark.parametrize("name", ["model", "geometry"])
def test_engine_derived_settings_are_refused_from_the_file_and_environment(name: str, tmp_path: Path) -> None:
    value = "acme/other" if name == "model" else '{"tokens_per_block": 32}'
    with pytest.raises(ConfigError, match=rf"'{name}' is set by environment variable KVTIER_{name.upper()}.*engine"):
        resolve_settings({}, LAYOUT, env={f"KVTIER_{name.upper()}": value})
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({name: "acme/other" if name == "model" else {"tokens_per_block": 32}}))
    with pytest.raises(ConfigError, match=rf"'{name}' is set by file .*kv\.json.*engine"):
        resolve_settings({"kvtier_config_file": str(cfg)}, LAYOUT, env={})


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"cpu_byte": 1}, r"unknown key 'cpu_byte'.*known keys"),
        ({"model": "x"}, r"come from the engine"),
        ({"geometry": {}}, r"come from the engine"),
        ({"cpu_bytes": 1, "cpu_bytes_to_use": 2}, r"twice"),
        ({"cpu_bytes": "lots"}, r"cpu_bytes"),
        ({"policy": "nope"}, r"policy"),
        ({"tiers": [{"type": "fs"}]}, r"tiers\[0\]"),
        ({"cpu_bytes": 1000}, r"holds no block"),
        ({"metrics_port": "9400"}, r"metrics_port"),
        ({"metrics_port": 70000}, r"metrics_port"),
    ],
)
def test_bad_extra_config_names_the_key(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve_settings(extra, LAYOUT, env={})


def test_metrics_port_is_carried_to_the_settings() -> None:
    assert resolve_settings({"metrics_port": 9400}, LAYOUT, env={}).metrics_port == 9400
    assert resolve_settings({}, LAYOUT, env={}).metrics_port is None


def test_kv_transfer_config_selects_the_spec_and_validates_early() -> None:
    cfg = kv_transfer_config(cpu_bytes="1GiB", block_size=64)
    assert cfg["kv_connector"] == "OffloadingConnector"
    extra = cfg["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == (SPEC_NAME, SPEC_MODULE_PATH)
    assert extra["cpu_bytes"] == "1GiB" and extra["block_size"] == 64
    with pytest.raises(ConfigError, match="unknown key"):
        kv_transfer_config(cpu_gigs=4)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"cpu_bytes": "abc"}, "cpu_bytes"),
        ({"policy": "nope"}, "policy"),
        ({"tiers": [{"type": "fs", "root": "/x", "read_thread": 1}]}, "read_thread"),
        ({"wait_timeout": 0}, "wait_timeout"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"region_name": "../x"}, "region_name"),
        ({"backpressure": {"bogus": 1}}, "backpressure.bogus"),
        ({"cpu_bytes": "1GiB", "num_cpu_blocks": 5}, "set only one of them"),
        # vLLM's own names for what kvtier calls otherwise: named, with what to write (docs/migration.md)
        ({"secondary_tiers": [{"type": "fs", "root_dir": "/x"}]}, "vLLM's key 'secondary_tiers'.*write 'tiers'"),
        ({"cache_policy_module_path": "m.p"}, "vLLM's key 'cache_policy_module_path'.*write 'policy'"),
    ],
)
def test_kv_transfer_config_refuses_a_bad_value_before_the_engine_starts(settings: dict[str, object], named: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review, 2026-12-05): only the keys' names were checked; every one of these
    returned a dict, and the mistake surfaced when vLLM built the spec. The caller's environment
    is not the engine's: it is left out (a bad KVTIER_* here changes nothing)."""
    monkeypatch.setenv("KVTIER_CPU_BYTES", "not a size")
    with pytest.raises(ConfigError, match=named):
        kv_transfer_config(**settings)
    assert kv_transfer_config(cpu_bytes="1GiB")["kv_connector_extra_config"]["cpu_bytes"] == "1GiB"


@pytest.mark.parametrize(("key", "value"), [("spec_name", "CPUOffloadingSpec"), ("spec_module_path", "my.spec"),
                                            ("spec_name", ["KvtierOffloadingSpec"])])
def test_kv_transfer_config_refuses_another_spec(key: str, value: object) -> None:
    """Regression (audit, 2026-12-05): ``spec_name``/``spec_module_path`` given with another value
    replaced kvtier's in the returned dict, so it no longer selected kvtier (vLLM's own spec then got
    kvtier's settings) without a word. kvtier's own values are accepted, as when left out."""
    with pytest.raises(ConfigError, match=f"{key} must be"):
        kv_transfer_config(**{key: value})
    cfg = kv_transfer_config(spec_name=SPEC_NAME, spec_module_path=SPEC_MODULE_PATH, cpu_bytes="1GiB")
    extra = cfg["kv_connector_extra_config"]
    assert (extra["spec_name"], extra["spec_module_path"]) == (SPEC_NAME, SPEC_MODULE_PATH)




def test_the_wait_deadlines_come_from_extra_config_and_are_checked_by_name() -> None:
    """``wait_timeout`` and ``failed_load_seconds`` are kvtier settings an engine can give (the
    vLLM page's table of extra-config keys, docs/vllm.md, lists them); a value out of range names the key."""
    s = resolve_settings({"wait_timeout": 2.5, "failed_load_seconds": 60}, LAYOUT, env={})
    assert s.config.wait_timeout == 2.5 and s.config.failed_load_seconds == 60.0
    for key, bad in (("wait_timeout", float("inf")), ("wait_timeout", 0), ("failed_load_seconds", 1e9),
                     ("failed_load_seconds", "soon")):  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            resolve_settings({key: bad}, LAYOUT, env={})


@pytest.mark.parametrize("value", ["false", "no", "0", 0, 1, "true", None, [], {}])
def test_allow_untested_vllm_takes_only_a_boolean(value: object) -> None:
    """Regression (review, 2026-12-02): ``"allow_untested_vllm": "false"`` was read with bool(),
    so the string turned the version check off."""
    from kvtier.integrations.vllm.config import allow_untested_vllm

    with pytest.raises(ConfigError, match="allow_untested_vllm"):
        allow_untested_vllm({"allow_untested_vllm": value})
    with pytest.raises(ConfigError, match="allow_untested_vllm"):
        resolve_settings({"allow_untested_vllm": value}, LAYOUT, env={})
    assert allow_untested_vllm({}) is False
    assert allow_untested_vllm({"allow_untested_vllm": True}) is True
    assert allow_untested_vllm({"allow_untested_vllm": False}) is False


@pytest.mark.parametrize(
    "extra", [{"cpu_bytes": None}, {"cpu_bytes": ""}, {"cpu_bytes_to_use": "  "}, {"policy": None}]
)
def test_a_null_or_empty_setting_is_refused_not_defaulted(extra: dict[str, object]) -> None:
    """Regression (review, 2026-12-02): ``{"cpu_bytes": null}`` and ``{"cpu_bytes": ""}`` silently
    gave the 4 GiB default, while an empty CLI flag value is refused."""
    with pytest.raises(ConfigError, match=r"is (null|empty): give a value"):
        resolve_settings(extra, LAYOUT, env={})

