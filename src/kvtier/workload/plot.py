"""``kvtier replay --plot``: hit rate against CPU capacity per policy, with its reference curves.

The left panel draws, against the CPU tier's capacity (log scale; in blocks, and
in bytes when the block size is known), each policy's prefix-hit rate through the
real manager (all tiers together), LRU as the baseline, Belady's offline optimum
for the CPU tier alone, and the unbounded cache. When secondary tiers were
replayed, the right panel splits each policy's hits by the tier that served them.

Needs matplotlib (the ``plot`` extra); the CLI checks for it before a run. Rendering
only, in memory, with the Agg backend; call from one thread at a time (pyplot's
figure registry is process-wide).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

from kvtier.units import format_size

WIDTH_IN, HEIGHT_IN, DPI = 12.0, 5.0, 100
"""The figure is 1200 x 500 pixels (PNG), laid out to be read at that size."""

_REFERENCE_STYLE = {
    "belady": {"color": "black", "linestyle": ":", "marker": "v"},
    "unbounded": {"color": "0.45", "linestyle": "--"},
    "lru": {"color": "tab:gray", "linestyle": "-.", "marker": "s"},
}


def _capacity_label(blocks: int, block_bytes: int | None) -> str:
    return str(blocks) if block_bytes is None else f"{blocks}\n{format_size(blocks * block_bytes)}"


def replay_plot_image(
    rows: Sequence[dict[str, Any]],
    policies: Sequence[str],
    *,
    title: str,
    block_bytes: int | None = None,
    block_note: str = "",
    kind: str = "png",
) -> bytes:
    """The figure of a capacity sweep as an image of type ``kind`` (png, svg, pdf: matplotlib's formats).

    ``rows``: :func:`kvtier.workload.report.replay_rows` (one per capacity, in any order);
    ``policies``: the policies asked for, drawn in that order (LRU is drawn as the
    baseline whether asked for or not). ``block_bytes``: KV bytes of one trace block,
    to label capacities as sizes too; ``block_note`` says what it is (model, tokens).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(rows, key=lambda r: r["capacity"])
    caps = [int(r["capacity"]) for r in ordered]
    tiers = _tier_names(ordered)
    split = len(tiers) > 1
    fig, axes = plt.subplots(1, 2 if split else 1, figsize=(WIDTH_IN, HEIGHT_IN), squeeze=False)
    ax = axes[0][0]
    drawn = [p for p in policies if p != "lru"]
    for name in drawn:
        ax.plot(caps, [100 * r["policies"][name]["hit_rate"] for r in ordered], marker="o", linewidth=2, label=name)
    lru_label = "lru (baseline)" if "lru" not in policies else "lru"
    ax.plot(caps, [100 * r["policies"]["lru"]["hit_rate"] for r in ordered], label=lru_label,
            **_REFERENCE_STYLE["lru"])  # fmt: skip
    belady = [(c, r["belady"]) for c, r in zip(caps, ordered, strict=True) if r.get("belady")]
    if belady:
        ax.plot([c for c, _ in belady], [100 * b["hit_rate"] for _, b in belady],
                label="Belady: CPU tier alone, offline optimum", **_REFERENCE_STYLE["belady"])  # fmt: skip
    ax.axhline(100 * ordered[0]["unbounded"]["hit_rate"], label="unbounded cache (any capacity)",
               **_REFERENCE_STYLE["unbounded"])  # fmt: skip
    if len(caps) > 1:
        ax.set_xscale("log")
    ax.set_xticks(caps)
    ax.set_xticklabels([_capacity_label(c, block_bytes) for c in caps], fontsize=9)
    ax.minorticks_off()
    ax.set_ylim(0, _top([ordered[0]["unbounded"]["hit_rate"], *(max(line.get_ydata()) / 100 for line in ax.lines)]))
    ax.set_xlabel("CPU tier capacity, blocks" + (f" / bytes ({block_note})" if block_bytes else ""), fontsize=11)
    ax.set_ylabel("prefix-hit rate, % of block references" + (" (all tiers)" if split else ""), fontsize=11)
    ax.set_title(title, fontsize=12, parse_math=False)  # a file name's "$...$" is text, not mathtext
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    if split:
        _tier_panel(axes[0][1], ordered, caps, [*drawn, "lru"], tiers, block_bytes)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, dpi=DPI, format=kind)
    plt.close(fig)
    return image.getvalue()


def _top(rates: Sequence[float]) -> float:
    """The y axis' top in %: the highest curve plus room for the legend, in steps of 10, at most 100."""
    return float(min(100, 10 * math.ceil((100 * max(rates) + 12) / 10)))


def _tier_names(rows: Sequence[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for row in rows:
        for result in row["policies"].values():
            for name in result.get("tier_hits", {}):
                if name not in names:
                    names.append(name)
    return names


def _tier_panel(
    ax: Any,
    rows: Sequence[dict[str, Any]],
    caps: Sequence[int],
    policies: Sequence[str],
    tiers: Sequence[str],
    block_bytes: int | None,
) -> None:
    """Stacked bars: per capacity, one bar per policy, split by the tier that served the hits."""
    width = 0.8 / len(policies)
    highest = 0.0
    palette = ["tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]  # not the policies'
    colors = [palette[i % len(palette)] for i in range(len(tiers))]
    for p, name in enumerate(policies):
        xs = [i - 0.4 + width * (p + 0.5) for i in range(len(caps))]
        bottom = [0.0] * len(caps)
        for t, tier in enumerate(tiers):
            heights = [100 * r["policies"][name].get("tier_hit_rates", {}).get(tier, 0.0) for r in rows]
            ax.bar(xs, heights, width * 0.95, bottom=bottom, color=colors[t], edgecolor="white",
                   label=tier if p == 0 else None)  # fmt: skip
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        highest = max(highest, *bottom)
        for x, top in zip(xs, bottom, strict=True):
            ax.text(x, top + 1, name, rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(caps)))
    ax.set_xticklabels([_capacity_label(c, block_bytes) for c in caps], fontsize=9)
    ax.set_ylim(0, min(100, _top([highest / 100]) + 10))  # + room for the policy names
    ax.set_xlabel("CPU tier capacity, blocks" + (" / bytes" if block_bytes else ""), fontsize=11)
    ax.set_ylabel("prefix hits served by each tier, % of references", fontsize=11)
    ax.set_title("hits by tier (bars: policies, left to right as labelled)", fontsize=12)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(title="tier", loc="upper left", fontsize=9)
