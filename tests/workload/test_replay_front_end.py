"""The pieces of ``kvtier replay``'s front end: capacities as sizes, the chaining check, the plot,
piped text without trailing spaces."""

from __future__ import annotations

import io
import struct

import pytest

from kvtier.errors import ConfigError
from kvtier.workload.capacity import Capacity, capacity_blocks, parse_capacities
from kvtier.workload.chaining import check_chaining
from kvtier.workload.synthetic import KINDS, generate
from kvtier.workload.textout import TrailingSpaceStripper
from kvtier.workload.trace import FlatTrace, TraceRequest

MIB = 1 << 20


def _flat(*requests: tuple[int, ...]) -> FlatTrace:
    return FlatTrace.from_requests([TraceRequest(i, 512 * len(ids), 1, ids) for i, ids in enumerate(requests)])


# --------------------------------------------------------------------------- capacities


def test_capacity_forms_are_read_exactly() -> None:
    entries = parse_capacities("9139, 5%,4GiB,4GB,1.5GiB,4G", max_blocks=1 << 28)
    assert entries[0] == Capacity("9139", blocks=9139)
    assert entries[1] == Capacity("5%", share=0.05)
    assert [e.nbytes for e in entries[2:]] == [4 << 30, 4 * 10**9, 3 << 29, 4 << 30]
    # 16 MiB blocks: whole blocks only, exact integers; duplicates dropped, order kept
    assert capacity_blocks(entries, 1000, 16 * MIB, 1 << 28) == [9139, 50, 256, 238, 96]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("0", "positive block counts"),
        ("-5", "not a block count"),
        ("5 blocks", "not understood"),
        ("1e3", "not a block count"),
        ("0%", "(0%, 100%]"),
        ("nan%", "not a percentage"),
        ("x%", "not a percentage"),
        ("0GiB", "must be positive"),
        ("4QiB", "not understood"),
        ("9" * 40, "at most 268435456 blocks"),
        ("268435457", "at most 268435456 blocks"),
        (",", "give block counts"),
        ("10,,20", "an empty entry"),
        ("10,20,", "an empty entry"),
        (",5%", "an empty entry"),
    ],
)
def test_bad_capacities_name_the_value_as_typed(text: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_capacities(text, max_blocks=1 << 28)
    message = str(info.value)
    assert message.startswith("--capacity "), message
    assert words in message
    if text.strip(","):
        assert repr(text.strip())[:20] in message


def test_sizes_need_a_block_size_and_whole_blocks() -> None:
    (size,) = parse_capacities("4GiB", max_blocks=1 << 28)
    with pytest.raises(ConfigError, match=r"--capacity '4GiB' is a size: give the model"):
        capacity_blocks([size], 100, None, 1 << 28)
    with pytest.raises(ConfigError, match=r"'4GiB' holds less than one block of 8.0 GiB"):
        capacity_blocks([size], 100, 8 << 30, 1 << 28)
    with pytest.raises(ConfigError, match=r"'4GiB' is 4194304 blocks of 1.0 KiB.*at most 1000 blocks"):
        capacity_blocks([size], 100, 1024, 1000)
    (share,) = parse_capacities("0.1%", max_blocks=10)
    with pytest.raises(ConfigError, match="less than one block"):
        capacity_blocks([share], 100, None, 10)


# --------------------------------------------------------------------------- chaining


@pytest.mark.parametrize("kind", KINDS)
def test_generated_workloads_are_chained(kind: str) -> None:
    assert check_chaining(FlatTrace.from_requests(generate(kind, 400, seed=3))).chained


def test_a_chained_trace_has_no_warning() -> None:
    report = check_chaining(_flat((0, 1, 2), (0, 1, 3), (4,), (0, 1, 2, 5)))
    assert report.chained and report.warning() is None
    assert report.to_dict()["chained"] is True


def test_ids_under_two_parents_are_counted() -> None:
    # 2 follows 1, then 4; 7 opens a request and follows 6; 9 repeats in one request.
    report = check_chaining(_flat((1, 2, 3), (4, 2, 3), (7,), (6, 7), (9, 9)))
    assert report.multi_parent_ids == 3  # 2, 7, 9 (the second 9 has parent 9)
    assert report.multi_parent_refs == 2 + 2 + 2
    assert report.repeating_requests == 1
    assert report.distinct_ids == 7 and report.block_refs == 11
    warning = report.warning()
    assert warning is not None
    assert "3 of 7 distinct hash_ids appear under more than one parent (6 of 11 block references)" in warning
    assert "1 requests repeat a hash_id" in warning


def test_empty_requests_and_an_empty_trace() -> None:
    assert check_chaining(_flat()).chained
    assert check_chaining(_flat((), (1, 2), (), (1, 2))).chained
    assert not check_chaining(_flat((), (1, 2), (), (2,))).chained


# --------------------------------------------------------------------------- text and plot


def test_trailing_spaces_are_dropped_and_nothing_else() -> None:
    out = io.StringIO()
    stream = TrailingSpaceStripper(out)
    for piece in ("a  ", "b\t \n", "  c ", " ", "\n", "d  "):
        stream.write(piece)
    stream.flush()
    assert out.getvalue() == "a  b\n  c\nd"
    stream.close()
    assert out.getvalue() == "a  b\n  c\nd"


def _png_size(image: bytes) -> tuple[int, int]:
    assert image[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", image[16:24])
    return width, height


def _row(capacity: int, rates: dict[str, float], tiers: dict[str, float] | None = None) -> dict[str, object]:
    def result(rate: float) -> dict[str, object]:
        split = tiers or {"cpu": rate}
        return {"hit_rate": rate, "tier_hits": dict.fromkeys(split, 1), "tier_hit_rates": split}

    return {
        "capacity": capacity,
        "policies": {name: result(rate) for name, rate in rates.items()},
        "belady": {"hit_rate": 0.3},
        "unbounded": {"hit_rate": 0.4},
    }


def test_the_plot_is_1200_pixels_wide_with_and_without_tiers() -> None:
    pytest.importorskip("matplotlib")
    from kvtier.workload.plot import replay_plot_image

    rows = [_row(c, {"arc": 0.1 * i, "lru": 0.05 * i}) for i, c in enumerate((100, 1000, 10000), start=1)]
    image = replay_plot_image(rows, ["arc"], title="t", block_bytes=MIB, block_note="tiny, 512 tokens a block")
    assert _png_size(image) == (1200, 500)
    tiered = [_row(c, {"lru": 0.2}, {"cpu": 0.1, "1:fs": 0.1}) for c in (10, 20)]
    assert _png_size(replay_plot_image(tiered, ["lru"], title="t")) == (1200, 500)
    one = [_row(5, {"lru": 0.2})]
    assert replay_plot_image(one, ["lru"], title="t", kind="svg").lstrip().startswith(b"<?xml")


def test_the_published_trace_is_prefix_chained() -> None:
    from pathlib import Path

    from kvtier.workload.trace import read_trace

    trace = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces" / "conversation_trace.jsonl"
    if not trace.exists():
        pytest.skip("shared Mooncake trace not present")
    report = check_chaining(FlatTrace.from_requests(read_trace(trace)))
    assert report.chained and report.block_refs == 288500 and report.distinct_ids == 182790
