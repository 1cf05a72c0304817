"""The configuration schema: precedence, every validation error, derived sizes, docs in step."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kvtier.config import (
    DEFAULT_CPU_BYTES,
    KvtierConfig,
    build_manager,
    describe_config,
    format_size,
    load_config,
    parse_size,
    render_config_reference,
    row_stride_for,
)
from kvtier.errors import ConfigError
from kvtier.keys import KVGeometry, Namespace
from kvtier.policies import DEFAULT_POLICY

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * 2**30),
        ("4G", 4 * 2**30),
        ("4 gib", 4 * 2**30),
        ("4GB", 4 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("4096", 4096),
        (4096, 4096),
        (8.0, 8),
        # Regression (review, 2026-12-03): sizes go "up to 8 EiB", but EiB was not a unit.
        ("7EiB", 7 * 2**60),
        ("1E", 2**60),
        ("1EB", 10**18),
    ],
)
def test_parse_size_accepts_units(text: str | int | float, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4XB", "lots", "-1", "", "1.2.3G", True, -5, 1.5, None])
def test_parse_size_rejects_with_accepted_forms(bad: object) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(bad)  # type: ignore[arg-type]
    assert "GiB" in str(err.value) or "bytes" in str(err.value)


def test_format_size() -> None:
    assert format_size(1536) == "1.5 KiB"
    assert format_size(100) == "100 B"
    assert format_size(3 * 2**30) == "3.0 GiB"


# --------------------------------------------------------------------------- defaults and derived values


def test_defaults_resolve_from_the_model_preset() -> None:
    config = load_config(env={})
    geo = config.kv_geometry()
    assert (geo.num_layers, geo.num_kv_heads, geo.head_dim, geo.tokens_per_block) == (32, 8, 128, 16)
    assert config.block_bytes == 2 * 32 * 8 * 128 * 2 * 16
    assert config.resolved_num_cpu_blocks() == DEFAULT_CPU_BYTES // config.row_stride
    assert config.model_id == "meta-llama/Llama-3.1-8B-Instruct"
    assert config.tiers == []


def test_namespace_is_stable_and_covers_geometry_and_parallel_layout() -> None:
    a = load_config(env={}).namespace()
    b = load_config(env={}).namespace()
    assert a.digest == b.digest
    assert isinstance(a, Namespace)
    other_block = load_config(env={}, cli={"geometry": '{"tokens_per_block": 32}'}).namespace()
    assert other_block.digest != a.digest
    assert load_config(env={}).namespace(tp_size=2, tp_rank=1).digest != a.digest


def test_preset_by_model_id_and_geometry_override() -> None:
    config = load_config(env={}, cli={"model": "Qwen/Qwen2.5-0.5B-Instruct", "geometry": '{"dtype": "fp8"}'})
    geo = config.kv_geometry()
    assert geo == KVGeometry(24, 2, 64, 16, "fp8", 2)


def test_unknown_model_with_full_geometry() -> None:
    config = load_config(
        env={}, cli={"model": "acme/llm-1", "geometry": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 64}}
    )
    assert config.model_id == "acme/llm-1"
    assert config.block_bytes == 2 * 2 * 1 * 64 * 2 * 16


def test_describe_config_derives_block_and_tier_sizes(tmp_path: Path) -> None:
    config = load_config(
        env={},
        cli={
            "model": "tiny",
            "geometry": {"tokens_per_block": 64},
            "cpu_bytes": "64MiB",
            "tiers": [
                {"type": "fs", "root": str(tmp_path), "max_bytes": "1GiB"},
                {"type": "redis", "url": "redis://x"},
            ],
        },
    )
    info = describe_config(config)
    block = 2 * 2 * 2 * 64 * 2 * 64
    assert info["bytes_per_block"] == block == 65536
    assert info["row_stride"] == row_stride_for(block)
    assert info["cpu"]["blocks"] == 64 * 2**20 // row_stride_for(block) == 1024
    assert info["cpu"]["tokens"] == 1024 * 64
    fs = info["tiers"][0]
    assert fs["capacity_bytes"] == 2**30
    assert fs["blocks"] == 2**30 // row_stride_for(block + 128)
    assert info["tiers"][1]["blocks"] is None
    json.dumps(info)  # JSON-able


def test_num_cpu_blocks_instead_of_bytes() -> None:
    config = load_config(env={}, cli={"num_cpu_blocks": 7})
    assert config.resolved_num_cpu_blocks() == 7
    assert describe_config(config)["cpu"]["blocks"] == 7


# --------------------------------------------------------------------------- precedence


def test_precedence_file_then_env_then_cli(tmp_path: Path) -> None:
    path = write(tmp_path, "kv.yaml", "policy: arc\ncpu_bytes: 1GiB\nshm_dir: /file\nregion_name: from-file\n")
    env = {"KVTIER_CPU_BYTES": "2GiB", "KVTIER_SHM_DIR": "/env", "OTHER": "x"}
    config = load_config(path, env=env, cli={"shm_dir": "/cli", "region_name": None})
    assert config.policy == "arc"  # file only
    assert config.cpu_bytes == 2 * 2**30  # env beats file
    assert config.shm_dir == "/cli"  # CLI beats env
    assert config.region_name == "from-file"  # a None CLI value means "not given"


def test_geometry_merges_key_by_key_across_sources(tmp_path: Path) -> None:
    path = write(tmp_path, "kv.json", json.dumps({"geometry": {"tokens_per_block": 32, "dtype": "float16"}}))
    config = load_config(path, env={"KVTIER_GEOMETRY": '{"tokens_per_block": 64}'})
    assert config.kv_geometry().tokens_per_block == 64
    assert config.kv_geometry().dtype == "float16"


def test_tiers_are_replaced_as_a_whole(tmp_path: Path) -> None:
    path = write(tmp_path, "kv.yaml", "tiers:\n  - type: fs\n    root: /a\n  - type: fs\n    root: /b\n")
    config = load_config(path, env={"KVTIER_TIERS": json.dumps([{"type": "fs", "root": "/c"}])})
    assert config.tiers == [{"type": "fs", "root": "/c"}]


def test_cpu_size_is_one_setting_across_sources(tmp_path: Path) -> None:
    path = write(tmp_path, "kv.toml", 'cpu_bytes = "8GiB"\n')
    config = load_config(path, env={}, cli={"num_cpu_blocks": 100})
    assert config.num_cpu_blocks == 100 and config.cpu_bytes is None
    config = load_config(path, env={"KVTIER_NUM_CPU_BLOCKS": "5"}, cli={"cpu_bytes": "1GiB"})
    assert config.cpu_bytes == 2**30 and config.num_cpu_blocks is None


def test_toml_and_yaml_kvtier_section(tmp_path: Path) -> None:
    toml = write(tmp_path, "kv.toml", '[kvtier]\npolicy = "arc"\n[[kvtier.tiers]]\ntype = "fs"\nroot = "/x"\n')
    assert load_config(toml, env={}).tiers == [{"type": "fs", "root": "/x"}]
    yaml = write(tmp_path, "kv.yml", "kvtier:\n  policy: arc\n")
    assert load_config(yaml, env={}).policy == "arc"
    empty = write(tmp_path, "empty.yaml", "")
    assert load_config(empty, env={}).policy == DEFAULT_POLICY == "return-time"


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_POLICY", "arc")
    assert load_config().policy == "arc"


def test_unknown_env_var_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        config = load_config(env={"KVTIER_CPU_BYTE": "1GiB", "KVTIER_UNRELATED_THING": "1"})
    assert config.cpu_bytes is None
    assert "did you mean KVTIER_CPU_BYTES" in caplog.text


# --------------------------------------------------------------------------- every validation error


@pytest.mark.parametrize(
    ("cli", "env", "expected"),
    [
        ({"cpu_bytes": "4XB"}, {}, ["cpu_bytes", "'512MiB'"]),
        ({"cpu_bytes": 0}, {}, ["cpu_bytes", "positive"]),
        ({}, {"KVTIER_CPU_BYTES": "-3"}, ["cpu_bytes", "from environment"]),
        ({"num_cpu_blocks": 0}, {}, ["num_cpu_blocks", "greater than 0"]),
        ({"num_cpu_blocks": "many"}, {}, ["num_cpu_blocks", "integer"]),
        ({"cpu_bytes": "1GiB", "num_cpu_blocks": 3}, {}, ["cpu_bytes and num_cpu_blocks", "only one"]),
        ({"policy": "Bad Policy"}, {}, ["policy", "'lru'"]),
        ({"policy": "mru"}, {}, ["policy 'mru' is unknown", "'arc'"]),
        ({"policy": "pkg.mod:"}, {}, ["policy", "package.module:ClassName"]),
        ({"model": "acme/unknown"}, {}, ["not a preset", "num_layers", "geometry="]),
        ({"model": " "}, {}, ["model", "preset name"]),
        ({"geometry": '{"num_layer": 3}'}, {}, ["geometry.num_layer", "did you mean 'num_layers'", "known names"]),
        ({"geometry": '{"head_dim": -1}'}, {}, ["geometry.head_dim", "greater than 0"]),
        ({"geometry": '{"dtype": "float7"}'}, {}, ["dtype", "bfloat16"]),
        ({"geometry": '{"kv_factor": 3}'}, {}, ["geometry.kv_factor", "1 or 2"]),
        ({"geometry": "{broken"}, {}, ["geometry from CLI flag --geometry", "JSON"]),
        ({}, {"KVTIER_TIERS": "[bad"}, ["KVTIER_TIERS", "JSON"]),
        ({"tiers": '"fs"'}, {}, ["tiers", "list"]),
        ({"tiers": "[42]"}, {}, ["tiers[0]", "mapping"]),
        ({"tiers": '[{"root": "/x"}]'}, {}, ["tiers[0]", "needs a 'type'"]),
        ({"tiers": '[{"type": "nfs"}]'}, {}, ["tiers[0].type 'nfs'", "'fs'"]),
        ({"tiers": '[{"type": "fs"}]'}, {}, ["tiers[0] (fs)", "root"]),
        ({"tiers": '[{"type": "fs", "root": "/x", "max_bytes": "lots"}]'}, {}, ["max_bytes", "GiB"]),
        ({"tiers": '[{"type": "fs", "root": "/x", "read_thread": 2}]'}, {}, ["read_thread", "read_threads"]),
        ({"tiers": '[{"type": "fs", "root": "/x", "fsync": "maybe"}]'}, {}, ["fsync", "bool"]),
        ({"tiers": '[{"type": "redis", "url": "http://x"}]'}, {}, ["url", "redis://"]),
        ({"tiers": '[{"type": "redis", "url": "redis://x", "ttl_seconds": 0}]'}, {}, ["ttl_seconds"]),
        ({"tiers": '[{"type": "redis", "url": "redis://x", "io_thread": 2}]'}, {}, ["'io_thread'", "'io_threads'"]),
        ({"cpu_byte": 1}, {}, ["'cpu_byte'", "did you mean 'cpu_bytes'"]),
        # Regression (review, 2026-12-03): 0 was accepted and made every shutdown with a secondary tier fail.
        ({"shutdown_timeout": 0}, {}, ["shutdown_timeout", "from CLI flag", "greater than 0"]),
        ({}, {"KVTIER_SHUTDOWN_TIMEOUT": "0"}, ["shutdown_timeout", "KVTIER_SHUTDOWN_TIMEOUT", "greater than 0"]),
    ],
)
def test_validation_errors_name_field_and_fix(cli: dict[str, object], env: dict[str, str], expected: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env=env, cli=cli)
    message = str(err.value)
    for fragment in expected:
        assert fragment in message, message


def test_cpu_bytes_smaller_than_one_row_is_explained() -> None:
    config = load_config(env={}, cli={"cpu_bytes": "1MiB"})
    with pytest.raises(ConfigError, match="raise cpu_bytes to at least 2097152"):
        config.resolved_num_cpu_blocks()


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(str(tmp_path / "missing.yaml"), env={})
    with pytest.raises(ConfigError, match=r"unknown extension '\.ini'"):
        load_config(write(tmp_path, "kv.ini", "x=1"), env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "kv.yaml", "policy: [unclosed"), env={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "kv.toml", "policy = "), env={})
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(write(tmp_path, "list.json", "[1, 2]"), env={})
    with pytest.raises(ConfigError, match=r"'polcy' \(did you mean 'policy'\?\) in file"):
        load_config(write(tmp_path, "typo.yaml", "polcy: arc\n"), env={})


def test_errors_name_their_source(tmp_path: Path) -> None:
    path = write(tmp_path, "kv.yaml", "cpu_bytes: nonsense\n")
    with pytest.raises(ConfigError, match=r"cpu_bytes' \(from file .*kv\.yaml\)"):
        load_config(path, env={})


def test_unimportable_tier_import_path_is_refused_when_the_config_loads() -> None:
    """An import path is checked when the config loads, not when the engine starts (tiers/test_registry.py
    covers out-of-tree tiers that do import)."""
    with pytest.raises(ConfigError, match=r"tiers\[0\].*'mypkg\.tiers' failed to import"):
        load_config(env={}, cli={"tiers": [{"type": "mypkg.tiers:Custom", "anything": 1}]})


def test_schema_is_serializable() -> None:
    schema = KvtierConfig.model_json_schema()
    assert "cpu_bytes" in schema["properties"]


# --------------------------------------------------------------------------- manager and docs


def test_build_manager_makes_a_working_manager(tmp_path: Path, shm_leak_check: None) -> None:
    config = load_config(
        env={},
        cli={
            "model": "tiny",
            "num_cpu_blocks": 8,
            "tiers": [{"type": "fs", "root": str(tmp_path / "fs"), "scan_in_background": False}],
        },
    )
    manager = build_manager(config)
    try:
        assert manager.primary.num_blocks == 8
        assert manager.block_bytes == config.block_bytes
        assert manager.rows.shape[0] == 8
        assert [t.tier_type for t in manager.tiers] == ["fs"]
    finally:
        manager.shutdown()


def test_docs_configuration_md_is_in_step_with_the_schema() -> None:
    expected = render_config_reference()
    assert DOCS.read_text() == expected, (
        "docs/configuration.md is out of date: run `kvtier config reference --output docs/configuration.md`"
    )
    for name in KvtierConfig.model_fields:
        assert f"`{name}`" in expected


def test_sources_name_where_each_value_came_from(tmp_path: Path) -> None:
    path = write(tmp_path, "kv.yaml", "policy: arc\nmodel: tiny\ngeometry:\n  tokens_per_block: 32\n")
    config = load_config(
        path,
        env={"KVTIER_SHM_DIR": str(tmp_path)},
        cli={"cpu_bytes": "8MiB", "geometry": '{"dtype": "float16"}'},
        defaults={"model": "qwen2.5-0.5b", "region_name": "r"},
        defaults_source="my defaults",
    )
    assert config.sources == {
        "cpu_bytes": "CLI flag --cpu-bytes",
        "num_cpu_blocks": "default",
        "policy": f"file {path}",
        "model": f"file {path}",
        "model_revision": "default",
        "geometry": "CLI flag --geometry",  # merged key by key; the last source that touched it
        "shm_dir": "environment variable KVTIER_SHM_DIR",
        "region_name": "my defaults",
        "tiers": "default",
        "backpressure": "default",
        "shutdown_timeout": "default",
        "wait_timeout": "default",
        "failed_load_seconds": "default",
    }
    assert config.kv_geometry().tokens_per_block == 32 and config.kv_geometry().dtype == "float16"
    engine = load_config(env={}, cli={"policy": "arc"}, cli_source="extra_config")
    assert engine.sources["policy"] == "extra_config['policy']"
    assert engine.model_copy().sources == engine.sources


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("dup.yaml", "cpu_bytes: 1GiB\ncpu_bytes: 2GiB\n"),
        ("nested.yaml", "tiers:\n  - type: fs\n    root: /a\n    root: /b\n"),
        ("dup.json", '{"cpu_bytes": "1GiB", "cpu_bytes": "2GiB"}'),
        ("nested.json", '{"tiers": [{"type": "fs", "root": "/a", "root": "/b"}]}'),
    ],
)
def test_a_key_named_twice_in_a_config_file_is_refused(tmp_path: Path, name: str, text: str) -> None:
    """Regression (review, 2026-12-02): YAML and JSON kept the last of two values of one key
    unnoticed (TOML refuses them)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="twice"):
        load_config(file=str(path), env={})


def test_a_key_named_twice_in_a_json_flag_or_variable_is_refused() -> None:
    twice = '[{"type": "fs", "root": "/a", "root": "/b"}]'
    with pytest.raises(ConfigError, match="'root' appears twice"):
        load_config(env={"KVTIER_TIERS": twice})
    with pytest.raises(ConfigError, match="'root' appears twice"):
        load_config(env={}, cli={"tiers": twice})


@pytest.mark.parametrize("name", ["../../etc/passwd", "a b", "x" * 300, "é/"])
def test_a_bad_region_name_is_refused_when_the_config_loads(name: str) -> None:
    """Regression (review, 2026-12-02): region_name was checked only when the region was made
    (mid-run in bench, at the first request under vLLM); one too long for a file name failed
    there with a raw OSError."""
    with pytest.raises(ConfigError, match="region_name"):
        load_config(env={}, cli={"region_name": name})
    assert load_config(env={}, cli={"region_name": "engine-0.kv_a"}).region_name == "engine-0.kv_a"


@pytest.mark.parametrize(
    "cli",
    [
        {"num_cpu_blocks": True},
        {"geometry": {"num_layers": True}},
        {"geometry": {"tokens_per_block": False}},
        {"backpressure": {"warmup_jobs": True}},
        {"tiers": [{"type": "fs", "root": "/tmp/kvtier-never-made", "read_threads": True}]},
        {"tiers": [{"type": "redis", "url": "redis://127.0.0.1:1", "failure_threshold": True}]},
    ],
)
def test_true_or_false_is_refused_where_a_number_belongs(cli: dict[str, object]) -> None:
    """Regression (review, 2026-12-02): pydantic read booleans as 1 and 0 in count fields
    (``num_cpu_blocks: true`` made a one-block CPU tier); sizes and durations refused them already."""
    with pytest.raises(ConfigError, match=r"must be a number, not (true|false)"):
        load_config(env={}, cli=cli)


@pytest.mark.parametrize("text", ["kvtier: 5\n", "kvtier:\n  cpu_bytes: 1GiB\npolicy: lru\n"])
def test_a_kvtier_section_must_be_alone_and_a_mapping(tmp_path: Path, text: str) -> None:
    """Regression (review, 2026-12-02): a malformed 'kvtier:' section was reported as an unknown
    setting 'kvtier' (did you mean 'tiers'?)."""
    path = tmp_path / "section.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="'kvtier:' section must be the file's only top-level key"):
        load_config(file=str(path), env={})


@pytest.mark.parametrize("field", ["num_cpu_blocks", "cpu_bytes"])
def test_true_for_the_cpu_size_names_the_file_it_came_from(tmp_path: Path, field: str) -> None:
    """Regression (docs audit, 2026-12-05): ``num_cpu_blocks: true`` (or ``cpu_bytes``) in a file or
    ``kv_connector_extra_config`` was refused as ``config: ... must be a number, not true``, naming
    neither the field's place nor the file, though every validation error names where the value
    came from (docs/config.md)."""
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"{field}: true\n")
    with pytest.raises(ConfigError) as caught:
        load_config(file=str(path), env={})
    assert str(caught.value).startswith(f"config field '{field}' (from file {path}): "), caught.value
    assert "true" in str(caught.value).lower()


@pytest.mark.parametrize(("values", "message"), [
    ({"cpu_bytes": ""}, "cpu_bytes from CLI flag --cpu-bytes is empty"),
    ({"num_cpu_blocks": " "}, "num_cpu_blocks from CLI flag --num-cpu-blocks is empty"),
    ({"region_name": ""}, "region_name from CLI flag --region-name is empty"),
    ({"shm_dir": "  "}, "shm_dir '  ' names no directory"),
])  # fmt: skip
def test_an_empty_value_given_as_a_flag_from_python_is_refused(values: dict[str, str], message: str) -> None:
    """Regression (2026-12-06, review): ``load_config(cli={"cpu_bytes": ""})`` was taken as not
    given (the default), ``{"shm_dir": "  "}`` as a directory named by two spaces, while the
    command line refuses an empty flag value (docs/config.md: one rule in every source)."""
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, cli=values)
    if "shm_dir" in values:  # a NUL too, from any source
        with pytest.raises(ConfigError, match=r"shm_dir '/dev/shm\\x00x' names no directory"):
            load_config(env={"KVTIER_SHM_DIR": "/dev/shm\0x"})


@pytest.mark.parametrize("given", [{"model": "tiny"}, None, "tiny"])
def test_build_manager_and_describe_config_name_what_they_take(given: object) -> None:
    """Regression (2026-12-06, review): ``build_manager({...})`` and ``describe_config(None)`` raised
    AttributeError from inside; they name what they take and how to make it."""
    from kvtier.config import build_manager, describe_config

    for call in (build_manager, describe_config):
        with pytest.raises(ConfigError, match=f"{call.__name__} takes a KvtierConfig, got a {type(given).__name__}: "
                                              "make one with kvtier.config.load_config"):  # fmt: skip
            call(given)  # type: ignore[arg-type]
