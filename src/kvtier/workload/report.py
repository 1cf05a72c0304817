"""Console tables, JSON files and plots for ``kvtier bench`` and ``kvtier replay``.

Rendering only: nothing here touches a manager. Call from any one thread.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvtier.config import format_size
from kvtier.user_files import write_output
from kvtier.workload.bench import BenchResult
from kvtier.workload.simulate import HitRateResult
from kvtier.workload.textout import text_console

_DIRECTION_NAMES = {
    "device_to_cpu": "device -> cpu (store)",
    "cpu_to_device": "cpu -> device (load)",
}


def _direction_name(direction: str) -> str:
    if direction in _DIRECTION_NAMES:
        return _DIRECTION_NAMES[direction]
    src, _, dst = direction.partition("_to_")
    kind = "cascade" if src == "cpu" else "promotion"
    return f"{src} -> {dst} ({kind})"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _summary_table(result: BenchResult, data: dict[str, Any]) -> Table:
    summary = Table(title="kvtier bench", show_header=False, title_justify="left")
    summary.add_column("what", no_wrap=True)
    summary.add_column("value", justify="right", no_wrap=True)
    geo = result.geometry
    options = data["options"]
    summary.add_row("model", str(options["model"]))
    summary.add_row("policy (cpu tier)", str(options["policy"]))
    summary.add_row("block", f"{geo['tokens_per_block']} tokens, {format_size(geo['bytes_per_block'])}")
    summary.add_row("device pool / cpu tier", f"{options['device_blocks']} / {options['cpu_blocks']} blocks")
    summary.add_row("requests", f"{result.requests}")
    summary.add_row("blocks (prompt refs / computed)", f"{result.block_refs} / {result.computed_blocks}")
    summary.add_row(
        "prefill tokens saved",
        f"{result.tokens_saved} of {result.prompt_tokens} ({_pct(data['prefill_tokens_saved_fraction'])})",
    )
    summary.add_row("loaded blocks verified byte-exact", f"{result.blocks_verified}")
    summary.add_row("errors", f"{result.errors}")
    if result.store_rejections:
        summary.add_row("stores refused (cpu tier pinned)", f"{result.store_rejections}")
    for label, watch in result.tier_health.items():
        if watch.unreachable:
            share = watch.steps_out_of_service / watch.steps if watch.steps else 1.0
            summary.add_row(f"{label} tier", f"[b]unreachable[/b] ({_pct(share)} of steps)")
        if watch.dropped_out_of_service:
            summary.add_row(f"{label} stores dropped (out of service)", str(watch.dropped_out_of_service))
        if watch.dropped_queue_full:
            summary.add_row(f"{label} stores shed (queue full)", str(watch.dropped_queue_full))
        if watch.dropped_no_room:
            summary.add_row(f"{label} stores dropped (no room)", str(watch.dropped_no_room))
        if result.stores_skipped.get(label):
            summary.add_row(f"{label} stores skipped (slow)", str(result.stores_skipped[label]))
    summary.add_row("wall time (setup)", f"{result.wall_s:.1f} s ({result.setup_s:.2f} s)")
    return summary


def bench_tables(result: BenchResult) -> list[Table]:
    """The bench report as rich tables: summary, hit rates, bytes moved, latency.

    Every table fits in 80 columns and no cell wraps, so piped output reads as it
    does on a terminal.
    """
    data = result.to_dict()
    summary = _summary_table(result, data)

    hits = Table(title="hit rate by tier (share of prompt blocks)", title_justify="left", min_width=60)
    hits.add_column("tier", no_wrap=True)
    hits.add_column("blocks", justify="right")
    hits.add_column("hit rate", justify="right")
    for tier, n in data["hits"].items():
        hits.add_row(tier, str(n), _pct(data["hit_rates"][tier]))
    hits.add_row("computed (miss)", str(result.computed_blocks),
                 _pct(result.computed_blocks / result.block_refs if result.block_refs else 0.0))  # fmt: skip
    hits.add_row("[b]total hits[/b]", str(sum(data["hits"].values())), _pct(data["total_hit_rate"]))

    moved = Table(title="bytes moved", title_justify="left", min_width=60)
    moved.add_column("direction", no_wrap=True)
    moved.add_column("bytes", justify="right")
    moved.add_column("GB/s", justify="right")
    for direction, n in data["bytes"].items():
        rate = data["gbps"].get(direction)
        moved.add_row(_direction_name(direction), format_size(n), f"{rate:.2f}" if rate else "-")

    lat = Table(title="scheduler-side latency", title_justify="left", min_width=60)
    lat.add_column("call", no_wrap=True)
    lat.add_column("p50", justify="right")
    lat.add_column("p99", justify="right")
    lat.add_column("count", justify="right")
    lt = data["latency"]
    lat.add_row("lookup (per block)", f"{lt['lookup_p50_us']:.1f} us", f"{lt['lookup_p99_us']:.1f} us",
                str(data["lookups"]))  # fmt: skip
    lat.add_row("kvtier per engine step", f"{lt['step_p50_us']:.1f} us", f"{lt['step_p99_us']:.1f} us",
                str(data["steps"]))  # fmt: skip
    return [summary, hits, moved, lat]


BENCH_NOTES = (
    "GB/s: device copies per copy-engine busy time, cascades per wall time with",
    "jobs in flight, promotions per job time.",
)


def print_bench(result: BenchResult, console: Console | None = None) -> None:
    """Print the tables, then one line per tier that was unreachable (with the tier's own words)."""
    console = console or text_console()
    summary, hits, moved, lat = bench_tables(result)
    console.print(summary)
    for label, watch in result.tier_health.items():
        if watch.unreachable:
            detail = watch.detail or "no detail"
            console.print(f"{label} tier out of service: {detail}", soft_wrap=True, highlight=False, markup=False)
    console.print(hits)
    console.print(moved)
    for line in BENCH_NOTES:
        console.print(line, soft_wrap=True, highlight=False)
    console.print(lat)


def json_document(data: Any) -> str:
    """``data`` as the indented JSON text ``--json`` writes."""
    return json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"


def write_json(path: str | os.PathLike[str], data: Any, flag: str = "--json") -> None:
    """Write ``data`` as indented JSON to ``path`` (``-``: standard output), rendered first, then
    written in place by :func:`kvtier.user_files.write_output` (no temporary file; never replaces
    what is at the path). Raises :class:`~kvtier.errors.ConfigError` naming ``flag`` and the path."""
    write_output(os.fspath(path), json_document(data), flag)


def plot_bench(result: BenchResult, path: str | os.PathLike[str], window: int = 16, flag: str = "--plot") -> None:
    """Write :func:`plot_image` of ``result`` to ``path`` (its suffix says the image type; PNG for ``-``),
    like :func:`write_json`."""
    kind = os.path.splitext(os.fspath(path))[1].lstrip(".").lower() or "png"
    write_output(os.fspath(path), plot_image(result, kind, window), flag)


def plot_image(result: BenchResult, kind: str = "png", window: int = 16) -> bytes:
    """Hit rate per tier over time (rolling over ``window`` requests) and bytes per tier, as an image
    of type ``kind`` (a matplotlib format: png, svg, pdf...), rendered in memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = ["device", *result.tiers]
    n = len(result.timeline)
    blocks = np.array([r.blocks for r in result.timeline], dtype=np.float64)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    if n:
        kernel = np.ones(min(window, n))
        denom = np.convolve(blocks, kernel, mode="valid")
        denom[denom == 0] = 1
        x = np.arange(len(denom)) + len(kernel)
        layers = []
        for tier in tiers:
            col = np.array(
                [r.device_hits if tier == "device" else r.tier_hits.get(tier, 0) for r in result.timeline],
                dtype=np.float64,
            )
            layers.append(100 * np.convolve(col, kernel, mode="valid") / denom)
        ax1.stackplot(x, *layers, labels=tiers)
        if x[-1] > x[0]:  # one point (a run shorter than the window): matplotlib warns on equal limits
            ax1.set_xlim(x[0], x[-1])
    ax1.set_ylim(0, 100)
    ax1.set_xlabel("request")
    ax1.set_ylabel(f"prefix-hit rate, % of blocks (rolling {window} requests)")
    ax1.set_title("hit rate by tier over time")
    ax1.legend(loc="upper left")
    names = [_direction_name(d) for d in result.bytes]
    values = [v / 1e9 for v in result.bytes.values()]
    ax2.barh(names, values, color="tab:blue")
    ax2.set_xlabel("GB moved")
    ax2.set_title("bytes by direction")
    ax2.invert_yaxis()
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=110, format=kind)
    plt.close(fig)
    return image.getvalue()


@functools.cache
def plot_format_problem(kind: str) -> str | None:
    """Why :func:`plot_image` cannot write a ``kind`` image here, or None when it can.

    Renders a tiny result through :func:`plot_image` itself into memory, so the answer covers
    what the real plot needs: a format that needs an external program (``pgf``: LaTeX) fails,
    and one that renders with a warning (``ps``/``eps``: no transparency) is refused with that
    warning's text, so an accepted format never prints a stray line. Needs matplotlib
    (ImportError otherwise); cached per ``kind``; about 0.1 s the first time.
    """
    from kvtier.workload.bench_result import RequestRecord

    probe = BenchResult(options={}, geometry={}, tiers=["cpu"], bytes={"device_to_cpu": 1, "cpu_to_device": 1})
    probe.timeline = [RequestRecord(f"r{i}", 4, i % 2, {"cpu": 1}, 3 - i % 2, 0.0) for i in range(4)]
    caught: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                caught.append(record.getMessage())

    handler = _Keep()
    log = logging.getLogger("matplotlib")
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False  # caught here, never printed
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            plot_image(probe, kind, window=2)
        caught.extend(str(w.message) for w in warned)
    except Exception as exc:  # any failure means the format cannot be written here
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    finally:
        log.removeHandler(handler)
        log.propagate = propagate
    return caught[0].splitlines()[0] if caught else None


def replay_table(rows: Sequence[dict[str, Any]], title: str, block_bytes: int | None = None) -> Table:
    """Hit rate per capacity and policy (real manager), its ratio to LRU, self-evictions, per-tier
    split, Belady, unbounded.

    ``block_bytes``: KV bytes of one trace block, to show each capacity as a size too.
    """
    table = Table(title=title, title_justify="left", caption_justify="left")
    table.add_column("capacity (blocks)" if block_bytes is None else "capacity (blocks, size)", justify="right")
    table.add_column("policy")
    table.add_column("hit rate", justify="right")
    table.add_column("x LRU", justify="right")
    table.add_column("self-evicted", justify="right")
    tier_names: list[str] = []
    for row in rows:
        for result in row["policies"].values():
            for name in result.get("tier_hits", {}):
                if name not in tier_names:
                    tier_names.append(name)
    show_tiers = len(tier_names) > 1
    if show_tiers:
        for name in tier_names:
            table.add_column(f"  {name}", justify="right")
    table.add_column("Belady (optimal)\nCPU tier alone", justify="right")
    table.add_column("unbounded\nany capacity", justify="right")
    table.add_column("lookup mean", justify="right")
    for row in rows:
        for i, (policy, kv) in enumerate(row["policies"].items()):
            first = i == 0
            capacity = str(row["capacity"])
            if block_bytes is not None:
                capacity += f" ({format_size(row['capacity'] * block_bytes)})"
            cells = [
                capacity if first else "", policy, _pct(kv["hit_rate"]), ratio_text(kv["ratio_to_lru"]),
                str(int(kv.get("self_evictions", 0))),
            ]  # fmt: skip
            if show_tiers:
                cells += [_pct(kv["tier_hit_rates"].get(n, 0.0)) for n in tier_names]
            belady = row.get("belady")
            cells.append((_pct(belady["hit_rate"]) if belady else "-") if first else "")
            cells.append(_pct(row["unbounded"]["hit_rate"]) if first else "")
            cells.append(f"{kv.get('lookup_us_mean', 0.0):.2f} us")
            table.add_row(*cells, end_section=i == len(row["policies"]) - 1)
    table.caption = (
        "prefix-hit rate: share of block references served from cache with every earlier block a hit; "
        "x LRU: hit rate over LRU's at the same capacity (-: LRU hit nothing); self-evicted: blocks evicted "
        "by a later store of their own request; "
        "Belady: the offline optimum of the CPU tier alone at that capacity, a bound on the "
        "cpu tier's hits, not on hits from secondary tiers; unbounded: a cache that never evicts, a bound "
        "on every policy, tier and capacity"
    )
    return table


def ratio_text(ratio: float | None) -> str:
    """A ratio to LRU as the tables show it; "-" where LRU hit nothing and the policy something
    (the JSON rows' None)."""
    return "-" if ratio is None else f"{ratio:.3f}"


def replay_rows(
    runs: dict[int, dict[str, HitRateResult]],
    policies: Sequence[str],
    belady: dict[int, HitRateResult | None],
    unbounded: HitRateResult,
) -> list[dict[str, Any]]:
    """The JSON rows of a capacity sweep: per capacity, every policy (``policies`` first, then LRU).

    ``kvtier`` repeats the first policy's result (the row format of a one-policy replay).
    """
    rows = []
    for capacity, by_policy in runs.items():
        order = list(dict.fromkeys([*policies, *by_policy]))
        results = {name: by_policy[name].to_dict() for name in order}
        b = belady.get(capacity)
        rows.append({
            "capacity": capacity,
            "kvtier": results[order[0]],
            "policies": results,
            "belady": b.to_dict() if b is not None else None,
            "unbounded": unbounded.to_dict(),
        })  # fmt: skip
    return rows
