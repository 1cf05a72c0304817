"""Numbers from every source (file, environment, flag, Python API): finite, bounded, exact, or refused by name.

``inf``, ``nan``, ``1e400``, a 401-digit size, ``1e-300`` for a rate: each is a
ConfigError naming the setting (or has a documented meaning), never an
OverflowError, a hang, or a crash at shutdown. Sizes are exact integers.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest

from kvtier import Namespace, TieringManager
from kvtier.backpressure import BackpressureSettings
from kvtier.config import load_config, parse_size
from kvtier.errors import ConfigError
from kvtier.units import format_size
from kvtier.workload.bench import BenchOptions
from kvtier.workload.chat import ChatWorkloadSpec

HUGE = "9" * 401
MAX_SIZE = 2**63 - 1  # the documented bounds, spelled out: the tests check behaviour, not names
MAX_SECONDS = 1_000_000.0
NON_FINITE_TEXT = ["inf", "-inf", "nan", "NaN", "Infinity", "1e400", "-1e400"]

# --------------------------------------------------------------------------- sizes: exact integers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("9007199254740993", 2**53 + 1),  # float rounding would give 2**53
        ("9223372036854775807", MAX_SIZE),
        ("18014398509481985B", 2**54 + 1),
        ("8191.999999999999PiB", 8191 * 2**50 + (999999999999 * 2**50) // 10**12),
        ("1.5GiB", 3 * 2**29),
        ("0.1KiB", 102),  # a fraction of a byte is dropped
        ("4096", 4096),
        (2**63 - 1, MAX_SIZE),
        (1e18, 10**18),
    ],
)
def test_sizes_are_exact_integers(text: str | int | float, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (HUGE, "(401 characters) is above the largest size kvtier accepts, 8 EiB"),
        ("9223372036854775808", "above the largest size"),
        ("8192PiB", "above the largest size"),
        ("8EiB", "above the largest size kvtier accepts, 8 EiB less one byte"),  # one byte above the largest offset
        ("1" + "0" * 40 + "KiB", "above the largest size"),
        ("0." + "1" * 60, "above the largest size"),  # more digits than any size has: refused before converting
        (10**400, "above the largest size"),
        (float("inf"), "is not a finite number"),
        (float("nan"), "is not a finite number"),
        (-1e-300, "whole, non-negative"),
        (1e-300, "whole, non-negative"),
        *[(text, "is not understood") for text in NON_FINITE_TEXT],
    ],
)
def test_sizes_out_of_range_are_refused_naming_the_value(value: Any, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_size(value)
    assert fragment in str(err.value), str(err.value)
    assert len(str(err.value)) < 300, "the value is shown shortened"


@pytest.mark.parametrize("n", [0, 1023, 2**53 + 1, MAX_SIZE, 2**200, 10**400, -(10**400)])
def test_format_size_never_overflows(n: int) -> None:
    assert format_size(n)


# --------------------------------------------------------------------------- the configuration, from every source


_FIELDS: list[tuple[str, str]] = [
    ("shutdown_timeout", "shutdown_timeout"),
    ("cpu_bytes", "cpu_bytes"),
    ("num_cpu_blocks", "num_cpu_blocks"),
    ("backpressure", "backpressure.high_seconds"),
    ("backpressure", "backpressure.low_seconds"),
    ("geometry", "geometry.num_layers"),
    ("geometry", "geometry.tokens_per_block"),
    ("backpressure", "backpressure.warmup_jobs"),
]


def _nested(field: str, name: str, raw: str) -> Any:
    """The value to give ``field`` so that ``name`` (maybe ``field.sub``) gets ``raw`` (JSON text)."""
    if "." not in name:
        return raw
    return '{"' + name.split(".", 1)[1] + '": ' + raw + "}"


@pytest.mark.parametrize(("field", "name"), _FIELDS)
@pytest.mark.parametrize("raw", ["Infinity", "-Infinity", "NaN", "1e400", "-1e400", HUGE, "1e308", "-1"])
@pytest.mark.parametrize("source", ["env", "cli", "file"])
def test_bad_numbers_are_config_errors_naming_the_setting(
    tmp_path: Path, field: str, name: str, raw: str, source: str
) -> None:
    """Regression: KVTIER_SHUTDOWN_TIMEOUT=inf passed validation and failed every tier's shutdown (OverflowError)."""
    value = _nested(field, name, raw)
    kwargs: dict[str, Any] = {"env": {}}
    flag = f"CLI flag --{field.replace('_', '-')}"
    where = {"env": f"KVTIER_{field.upper()}", "cli": flag, "file": "from file "}[source]
    if source == "env":
        kwargs["env"] = {f"KVTIER_{field.upper()}": value}
    elif source == "cli":
        kwargs["cli"] = {field: value}
    else:
        path = tmp_path / "kv.json"
        path.write_text('{"' + field + '": ' + value + "}")  # JSON: NaN, Infinity, 1e400 (= inf) as numbers
        kwargs["file"] = str(path)
    try:
        config = load_config(**kwargs)
    except ConfigError as exc:
        text = str(exc)
        assert name in text and where in text, text
        assert "Traceback" not in text and len(text) < 600, text
        return
    # Accepted: then the value is finite and within its documented bounds (e.g. 1e308 seconds never is).
    got = getattr(config, field)
    if "." in name:
        got = getattr(got, name.split(".", 1)[1])
    pytest.fail(f"{name}={raw!r} from {source} was accepted as {got!r}")


@pytest.mark.parametrize("text", ["none", "null", "None", " NULL "])
def test_no_deadline_has_a_documented_spelling_in_text_and_files(tmp_path: Path, text: str) -> None:
    assert load_config(env={"KVTIER_SHUTDOWN_TIMEOUT": text}).shutdown_timeout is None
    assert load_config(env={}, cli={"shutdown_timeout": text}).shutdown_timeout is None
    path = tmp_path / "kv.yaml"
    path.write_text("shutdown_timeout: null\n")
    assert load_config(path, env={}).shutdown_timeout is None  # a file's null is a value, not "not given"
    assert load_config(path, env={"KVTIER_SHUTDOWN_TIMEOUT": "30"}).shutdown_timeout == 30.0
    assert load_config(env={"KVTIER_SHUTDOWN_TIMEOUT": ""}).shutdown_timeout == 120.0  # empty = unset


@pytest.mark.parametrize("value", ["1e-300", "0.5", str(MAX_SECONDS)])
def test_tiny_and_bounded_durations_are_accepted_as_given(value: str) -> None:
    assert load_config(env={"KVTIER_SHUTDOWN_TIMEOUT": value}).shutdown_timeout == float(value)


# --------------------------------------------------------------------------- the Python API


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e308, 10**400, -1, -1e-300, "5", True])
def test_manager_timeouts_are_checked_at_every_entry(namespace: Namespace, tmp_path: Path, bad: Any) -> None:
    """create(), the constructor and shutdown(timeout=) refuse what threading would overflow on."""
    for name in ("shutdown_timeout", "drain_timeout"):
        with pytest.raises(ConfigError, match=name):
            TieringManager.create(namespace=namespace, num_cpu_blocks=4, shm_dir=tmp_path, **{name: bad})
    assert not list(tmp_path.iterdir()), "a region was created before the check"
    mgr = TieringManager.create(
        namespace=namespace, num_cpu_blocks=4, shm_dir=tmp_path, tiers=[{"type": "memory", "max_bytes": 1 << 20}]
    )
    try:
        with pytest.raises(ConfigError, match=r"reset_cache\(drain_timeout=...\)"):
            mgr.reset_cache(drain_timeout=bad)
        with pytest.raises(ConfigError, match=r"shutdown\(timeout=...\)"):
            mgr.shutdown(timeout=bad)
        assert not mgr.is_shut_down
    finally:
        mgr.shutdown()
    assert mgr.is_shut_down and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"cpu_bytes": math.inf}, "cpu_bytes: size inf is not a finite number"),
        ({"cpu_bytes": math.nan}, "cpu_bytes: size nan"),
        ({"cpu_bytes": "1e400"}, "cpu_bytes: size '1e400' is not understood"),
        ({"cpu_bytes": 10**400}, "cpu_bytes: size"),
        ({"cpu_bytes": HUGE}, "cpu_bytes: size"),
        ({"num_cpu_blocks": 1.5}, "num_cpu_blocks must be a positive integer"),
        ({"num_cpu_blocks": True}, "num_cpu_blocks must be a positive integer"),
        ({"num_cpu_blocks": 0}, "num_cpu_blocks must be a positive integer"),
        ({"num_cpu_blocks": "8"}, "num_cpu_blocks must be a positive integer"),
        # Regression (review, 2026-12-05): both were taken, cpu_bytes silently dropped
        ({"num_cpu_blocks": 4, "cpu_bytes": "8MiB"}, "cpu_bytes ('8MiB') and num_cpu_blocks (4) are both given"),
        # Regression (2026-12-05, twenty-first session): an int past Python's 4,300-digit str() limit
        # was a bare ValueError from a message's formatting (here, in the region's space check, ...)
        ({"num_cpu_blocks": 10**5000}, "num_cpu_blocks=an integer of 16610 bits rows of"),
        ({"num_cpu_blocks": 2**62}, "are above the largest size kvtier accepts (8 EiB): give fewer blocks"),
        ({"num_cpu_blocks": 10**5000, "cpu_bytes": "1G"}, "num_cpu_blocks (<int of 16610 bits>) are both given"),
        ({"cpu_bytes": 10**5000}, "size an integer of 16610 bits is above the largest size"),
        ({"cpu_bytes": -(10**5000)}, "size an integer of 16610 bits is negative"),
    ],
)
def test_manager_sizes_are_checked_before_the_region_exists(
    namespace: Namespace, tmp_path: Path, kwargs: dict[str, Any], fragment: str
) -> None:
    """Regression: cpu_bytes=inf or num_cpu_blocks=1.5 was a TypeError from deep inside."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        TieringManager.create(namespace=namespace, shm_dir=tmp_path, **kwargs)
    assert not list(tmp_path.iterdir())


def test_a_config_deadline_reaches_the_manager_and_shutdown_completes(namespace: Namespace, tmp_path: Path) -> None:
    """Regression: KVTIER_SHUTDOWN_TIMEOUT=inf made every tier's shutdown fail with OverflowError."""
    from kvtier.config import build_manager

    with pytest.raises(ConfigError, match="KVTIER_SHUTDOWN_TIMEOUT"):
        load_config(env={"KVTIER_SHUTDOWN_TIMEOUT": "inf"})
    for text in ("none", str(MAX_SECONDS)):
        config = load_config(env={"KVTIER_SHUTDOWN_TIMEOUT": text, "KVTIER_MODEL": "tiny",
                                  "KVTIER_NUM_CPU_BLOCKS": "4", "KVTIER_SHM_DIR": str(tmp_path),
                                  "KVTIER_TIERS": '[{"type": "memory", "max_bytes": 1048576}]'})  # fmt: skip
        mgr = build_manager(config)
        mgr.shutdown()
        assert mgr.is_shut_down
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"high_seconds": math.inf}, "high_seconds"),
        ({"high_seconds": 1e308}, "high_seconds"),
        ({"low_seconds": math.nan}, "low_seconds"),
        ({"warmup_jobs": 10**400}, "warmup_jobs"),
        ({"warmup_jobs": 10**9}, "warmup_jobs"),
        ({"smoothing": math.nan}, "smoothing"),
    ],
)
def test_backpressure_settings_refuse_non_finite_and_unbounded_values(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        BackpressureSettings(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"sessions": 10**9}, "sessions must be an integer in"),
        ({"sessions": 10**400}, "sessions must be an integer in"),
        ({"max_turns": 10**6}, "max_turns"),
        ({"shared_system_prompts": 10**8}, "shared_system_prompts"),
        ({"seed": 2**64}, "seed"),
        ({"system_tokens": (1, 10**12)}, "system_tokens"),
        ({"mean_think_s": math.inf}, "mean_think_s"),
        ({"sessions": 2.5}, "sessions"),
    ],
)
def test_workload_counts_are_bounded(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        ChatWorkloadSpec(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"device_blocks": 10**8}, "device_blocks"),
        ({"device_blocks": 10**400}, "device_blocks"),
        ({"batch_size": 10**9}, "batch_size"),
        ({"prefill_tokens_per_s": 1e-300}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": math.inf}, "prefill_tokens_per_s"),
        ({"prefill_tokens_per_s": math.nan}, "prefill_tokens_per_s"),
        ({"stall_timeout_s": math.inf}, "stall_timeout_s"),
        ({"stall_timeout_s": 0}, "stall_timeout_s"),
    ],
)
def test_bench_options_are_bounded(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        BenchOptions(**kwargs)


def test_check_seconds_says_the_range_and_none() -> None:
    from kvtier.validation import check_seconds

    with pytest.raises(ConfigError, match=r"x=inf is not a usable duration: give a number of seconds at least 0 and "
                                          r"at most 1000000 or None \(no deadline\)"):  # fmt: skip
        check_seconds(math.inf, "x", allow_none=True)
    assert check_seconds(None, "x", allow_none=True) is None
    assert check_seconds(2, "x") == 2.0


def test_the_documented_bounds_are_the_code_s() -> None:
    from kvtier.units import MAX_SIZE as size_bound
    from kvtier.validation import MAX_SECONDS as seconds_bound

    assert (size_bound, seconds_bound) == (MAX_SIZE, MAX_SECONDS)


@pytest.mark.parametrize(
    "text",
    [
        "wait_timeout: true",
        "failed_load_seconds: false",
        "shutdown_timeout: true",
        "backpressure: {high_seconds: true}",
        "tiers: [{type: fs, root: /tmp/kvtier-never-made, shutdown_timeout: true}]",
        "tiers: [{type: redis, url: 'redis://127.0.0.1:1', ttl_seconds: false}]",
        "tiers: [{type: s3, bucket: b, request_timeout: true}]",
    ],
)
def test_a_boolean_is_not_a_number_of_seconds(tmp_path: Path, text: str) -> None:
    """Regression: ``true`` in a config file was taken as 1.0 s by every duration setting."""
    path = tmp_path / "kv.yaml"
    path.write_text(text + "\n")
    name = re.findall(r"(\w+): (?:true|false)", text)[0]
    with pytest.raises(ConfigError, match=rf"{name}.*a number of seconds, not (true|false)"):
        load_config(str(path), env={})


def test_messages_name_an_integer_too_long_to_print() -> None:
    """Regression (2026-12-05, twenty-first session): ``str()`` of an int of more than 4,300
    digits raises ValueError, and the config messages formatted the value they refuse with it
    (``check_seconds``, ``shown_value``: any setting given such an int)."""
    from kvtier.validation import check_seconds, shown_value

    huge = 10**5000
    assert shown_value(huge) == "<int of 16610 bits>"
    assert shown_value([huge, "a"]) == "[<int of 16610 bits>, 'a']"
    with pytest.raises(ConfigError, match=re.escape("timeout=an integer of 16610 bits is longer than")):
        check_seconds(huge, "timeout")
    with pytest.raises(ConfigError, match="size an integer of 16610 bits is above"):
        parse_size(huge)
