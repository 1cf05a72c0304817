"""The ``kvtier`` command.

Subcommands:

* ``kvtier bench``: a multi-turn chat workload through the whole stack with real
  bytes (CPU tier in /dev/shm + an fs tier in a lock-held temp dir by default).
* ``kvtier replay TRACE.jsonl`` (or ``--synthetic KIND``): metadata-only replay of
  a Mooncake trace or a generated workload through the real manager, hit rate per
  policy and capacity with its ratio to LRU, beside unbounded and Belady references.
* ``kvtier sweep [--remove]``: everything dead kvtier processes left (stale
  regions, bench temp dirs); ``kvtier sweep-shm`` the regions only.
* ``kvtier inspect DIR|S3-URL [--verify|--sample N]``: summary of an fs tier directory or an S3 prefix.
* ``kvtier config show|reference|schema``: the resolved configuration and its sizes.

Settings resolve as default < ``--config FILE`` < ``KVTIER_*`` environment <
flags for every command that reads them. Inputs are checked before any work
(numbers at parse time, output paths and optional dependencies before a run).

Exit status, for every command: 0 success; 1 the command ran and found a problem
(wrong bytes loaded, a failed copy or tier job, corrupt entries); 2 bad usage,
configuration or environment (the message names the input and the fix).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.config import (
    KvtierConfig,
    cli_flag,
    describe_config,
    format_size,
    load_config,
    parse_size,
    render_config_reference,
)
from kvtier.errors import ConfigError, KvtierError
from kvtier.version import __version__

logger = logging.getLogger("kvtier.cli")

DEFAULT_CAPACITIES = "1000,5000,9139,20000,50000"


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_size(text: str) -> int:
    size = _size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive, e.g. '256MiB'")
    return size


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``, refused at parse time (exit 2) otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _float_at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a finite number >= ``low``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number of at least {low:g}, got {text}")
        return value

    return parse


def _port(text: str) -> int:
    value = _int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535] (0 = any free port), got {value}")
    return value


def check_output_file(path: str, flag: str) -> None:
    """Refuse, before any work, an output path whose directory is missing or unwritable (exit 2)."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path!r} is a directory: give a file name")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path!r}: directory {str(parent)!r} does not exist: create it or pick another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: directory {str(parent)!r} is not writable: pick another path")


def check_plot_file(path: str) -> None:
    """Refuse ``--plot`` before the run when matplotlib is missing or the file type is not one it writes."""
    check_output_file(path, "--plot")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed: pip install 'kvtier[plot]'") from None
    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in kinds:
        what = repr(suffix) if suffix else "a file without a suffix"
        raise ConfigError(f"--plot {path!r}: matplotlib cannot write {what}: use a suffix from {kinds}")


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _say(console: Any, text: str) -> None:
    """One line to ``console`` as is: no markup, no highlighting, no hard wrapping."""
    console.print(text, soft_wrap=True, highlight=False, markup=False)


# --------------------------------------------------------------------------- bench


def _add_bench(sub: Any) -> None:
    from kvtier.workload.bench import DEFAULT_BENCH_CPU_BYTES, DEFAULT_BENCH_FS_BYTES, DEFAULT_BENCH_MODEL

    p = sub.add_parser(
        "bench",
        help="run a multi-turn chat workload through the tiers with real bytes",
        description=(
            "Run a deterministic multi-turn chat workload through kvtier: a simulated device KV pool, "
            "the CPU tier in /dev/shm and an fs tier (temp dir unless --fs-root), moving and verifying "
            "real bytes. Prints hit rates per tier, bandwidth, scheduler-side latency and prefill saved. "
            "Settings resolve as bench defaults < --config file < KVTIER_* environment < flags. "
            "Exit status: 0 success, 1 a loaded block had wrong bytes or a copy/tier job failed, "
            "2 bad usage, configuration or environment."
        ),
    )
    positive, non_negative = _int_at_least(1), _int_at_least(0)
    w = p.add_argument_group("workload")
    w.add_argument("--sessions", type=positive, metavar="N", default=48, help="chat sessions (default 48)")
    w.add_argument("--min-turns", type=positive, metavar="N", default=2,
                   help="turns per session, lower bound (default 2)")  # fmt: skip
    w.add_argument("--max-turns", type=positive, metavar="N", default=6,
                   help="turns per session, upper bound (default 6)")  # fmt: skip
    w.add_argument("--shared-prompts", type=non_negative, metavar="N", default=4,
                   help="shared system prompts (default 4)")  # fmt: skip
    w.add_argument("--seed", type=non_negative, metavar="N", default=0, help="workload seed (default 0)")
    w.add_argument("--batch-size", type=positive, metavar="N", default=4,
                   help="requests admitted per engine step (default 4)")  # fmt: skip
    w.add_argument(
        "--prefill-tokens-per-s", type=_float_at_least(0.0), metavar="TOKENS", default=25_000.0,
        help="simulated device prefill speed; 0 = instantaneous (default 25000)",
    )  # fmt: skip
    s = p.add_argument_group("sizes and tiers")
    s.add_argument(
        "--config", metavar="FILE", default=None,
        help="bench this kvtier config (YAML/TOML/JSON): its CPU size, policy, model, geometry and tiers; "
        "KVTIER_* environment variables and the flags below override it; --fs-root/--redis add tiers",
    )  # fmt: skip
    s.add_argument("--model", metavar="PRESET", default=None, help=f"model preset (default {DEFAULT_BENCH_MODEL})")
    s.add_argument("--tokens-per-block", type=positive, metavar="N", default=None,
                   help="tokens per KV block (default 16)")  # fmt: skip
    s.add_argument(
        "--cpu-bytes", type=_positive_size, metavar="SIZE", default=None,
        help=f"CPU tier size (default {format_size(DEFAULT_BENCH_CPU_BYTES)})",
    )  # fmt: skip
    s.add_argument("--device-blocks", type=positive, metavar="N", default=512,
                   help="simulated device pool, blocks (default 512)")  # fmt: skip
    s.add_argument("--policy", metavar="NAME", default=None, help="CPU tier eviction policy (default lru)")
    s.add_argument("--shm-dir", metavar="DIR", default=None, help="directory of the CPU region (default /dev/shm)")
    s.add_argument(
        "--fs-root", metavar="DIR", default=None,
        help="fs tier directory (kept); default: a lock-held temp dir, removed after (none if the config has tiers)",
    )  # fmt: skip
    s.add_argument(
        "--fs-bytes", type=_positive_size, metavar="SIZE", default=DEFAULT_BENCH_FS_BYTES,
        help=f"fs tier capacity (default {format_size(DEFAULT_BENCH_FS_BYTES)})",
    )  # fmt: skip
    s.add_argument("--no-fs", action="store_true", help="run without the bench's fs tier")
    s.add_argument("--redis", metavar="URL", default=None, help="add a redis tier, e.g. redis://127.0.0.1:6379/0")
    s.add_argument(
        "--s3", metavar="URL", default=None,
        help="add an S3 tier: s3://bucket/prefix (AWS) or http(s)://[key:secret@]host:port/bucket/prefix",
    )  # fmt: skip
    s.add_argument(
        "--memory-tier", metavar="SIZE", nargs="?", const="256MiB", default=None, type=_positive_size,
        help="add the in-process reference memory tier (default size 256MiB)",
    )  # fmt: skip
    s.add_argument(
        "--strict", action="store_true",
        help="a configured tier that is unreachable (circuit breaker open) is an error (exit 2)",
    )  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", default=None, help="write the full result as JSON")
    o.add_argument("--plot", metavar="FILE.png", default=None, help="plot hit rate over time and bytes per tier")
    o.add_argument("--metrics-port", type=_port, metavar="PORT", default=None,
                   help="serve Prometheus metrics while running")  # fmt: skip
    o.add_argument("--metrics-addr", metavar="ADDR", default="127.0.0.1",
                   help="address for --metrics-port (default 127.0.0.1)")  # fmt: skip
    o.add_argument("--no-progress", action="store_true", help="no progress bar (none is shown when not on a terminal)")
    p.set_defaults(func=_cmd_bench)


def _bench_config(args: argparse.Namespace) -> KvtierConfig:
    """The bench's configuration: bench defaults < --config file < KVTIER_* environment < flags."""
    from kvtier.workload.bench import BENCH_DEFAULTS

    flags: dict[str, Any] = {
        "cpu_bytes": args.cpu_bytes, "policy": args.policy, "model": args.model, "shm_dir": args.shm_dir,
        "geometry": None if args.tokens_per_block is None else {"tokens_per_block": args.tokens_per_block},
    }  # fmt: skip
    return load_config(args.config, cli=flags, defaults=BENCH_DEFAULTS, defaults_source="kvtier bench default")


def _extra_bench_tiers(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Tiers added by --s3 and --memory-tier, behind --fs-root/--redis."""
    tiers: list[dict[str, Any]] = []
    if args.s3:
        from kvtier.tiers.s3_inspect import options_from_url

        tiers.append({"type": "s3", **options_from_url(args.s3)})
    if args.memory_tier is not None:
        tiers.append({"type": "memory", "max_bytes": args.memory_tier})
    return tiers


def _bench_options(args: argparse.Namespace, config: KvtierConfig) -> Any:
    from kvtier.workload.bench import BenchOptions
    from kvtier.workload.chat import ChatWorkloadSpec

    if args.min_turns > args.max_turns:
        raise ConfigError(f"--min-turns {args.min_turns} is above --max-turns {args.max_turns}: lower or raise one")
    workload = ChatWorkloadSpec(
        sessions=args.sessions,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        shared_system_prompts=args.shared_prompts,
        seed=args.seed,
    )
    own_tiers = config.sources["tiers"] != "default"
    return BenchOptions(
        workload=workload,
        device_blocks=args.device_blocks,
        fs=not args.no_fs and (args.fs_root is not None or not own_tiers),
        fs_root=args.fs_root,
        fs_bytes=args.fs_bytes,
        redis_url=args.redis,
        extra_tiers=_extra_bench_tiers(args),
        batch_size=args.batch_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        base_config=config,
        strict=args.strict,
    )


def _run_bench_showing_progress(options: Any, metrics: Any, err: Any, show: bool) -> Any:
    """Run the bench; a rich progress bar on stderr when ``show`` (a terminal), tier events as lines."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvtier.workload.bench import run_bench

    def notify(line: str) -> None:
        _say(err, f"kvtier bench: {line}")

    if not show:
        return run_bench(options, metrics=metrics, notify=notify)
    columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("bench", total=None)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        return run_bench(options, progress=progress, metrics=metrics, notify=notify)


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.metrics import KvtierMetrics
    from kvtier.workload.bench import describe_options
    from kvtier.workload.report import plot_bench, print_bench, write_json

    if args.json:
        check_output_file(args.json, "--json")
    if args.plot:
        check_plot_file(args.plot)
    config = _bench_config(args)
    options = _bench_options(args, config)
    options.config(options.fs_root)  # the tiers the bench adds (--redis ...) are checked before anything runs
    err = _stderr_console()
    _say(err, f"kvtier bench: {describe_options(options)}")
    chosen = [f"{name} ({source})" for name, source in config.sources.items() if "default" not in source]
    if chosen:
        _say(err, "kvtier bench: settings from " + ", ".join(chosen))
    metrics: KvtierMetrics | None = None
    if args.metrics_port is not None:
        metrics = KvtierMetrics()
        try:
            port = metrics.serve(args.metrics_port, args.metrics_addr)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {args.metrics_port}: cannot listen on {args.metrics_addr}: {exc.strerror or exc}"
            ) from None
        _say(err, f"serving Prometheus metrics on http://{args.metrics_addr}:{port}/metrics")
    try:
        result = _run_bench_showing_progress(options, metrics, err, show=not args.no_progress and err.is_terminal)
    finally:
        if metrics is not None:
            metrics.close()
    print_bench(result, Console())
    if args.json:
        write_json(args.json, result.to_dict())
        _say(err, f"wrote {args.json}")
    if args.plot:
        plot_bench(result, args.plot)
        _say(err, f"wrote {args.plot}")
    return 1 if result.errors else 0


# --------------------------------------------------------------------------- replay

DEFAULT_SYNTHETIC_CAPACITIES = "0.5%,1%,2%,5%,10%,20%"


def _capacity_list(text: str) -> list[int | float]:
    """Block counts (``9139``, ``4k``) or shares of the trace's distinct blocks (``5%``, as a float)."""
    values: list[int | float] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.endswith("%"):
            try:
                share = float(part[:-1]) / 100
            except ValueError:
                raise argparse.ArgumentTypeError(f"--capacity {part!r}: not a percentage like 5%") from None
            if not 0 < share <= 1:
                raise argparse.ArgumentTypeError(f"--capacity {part!r}: a share must lie in (0%, 100%]")
            values.append(share)
            continue
        try:
            values.append(int(parse_size(part)))
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"--capacity {text!r}: give positive block counts or shares of the distinct blocks, "
            "e.g. 1000,9139,50000 or 1%,5%"
        )
    return values


def _policy_list(text: str) -> list[str]:
    from kvtier.policies import resolve_policy

    names = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"--policy {text!r}: give policy names, e.g. lru,arc,return-time")
    for name in names:
        try:
            resolve_policy(name)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _add_replay(sub: Any) -> None:
    from kvtier.policies import DEFAULT_POLICY
    from kvtier.workload.synthetic import DEFAULT_REQUESTS, KINDS

    p = sub.add_parser(
        "replay",
        help="replay a Mooncake trace or a generated workload (metadata only): hit rate per policy and capacity",
        description=(
            "Replay a Mooncake-format JSON-lines trace (timestamp, input_length, output_length, hash_ids), "
            "or a generated workload (--synthetic), through the real TieringManager without moving KV bytes. "
            "For each --capacity and each --policy prints kvtier's prefix-hit rate and its ratio to LRU's, "
            "beside two references: Belady's offline optimum and an unbounded cache."
        ),
    )
    p.add_argument("trace", nargs="?", default=None, help="trace file (JSON lines); or use --synthetic")
    p.add_argument(
        "--synthetic", metavar="KIND", choices=KINDS, default=None,
        help=f"replay a generated workload instead of a trace: {', '.join(KINDS)}",
    )  # fmt: skip
    p.add_argument("--requests", type=_int_at_least(1), default=DEFAULT_REQUESTS,
                   help=f"requests of the generated workload (default {DEFAULT_REQUESTS})")  # fmt: skip
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="seed of the generated workload (default 0)")
    p.add_argument(
        "--capacity", type=_capacity_list, default=None,
        help="CPU tier sizes, comma separated: blocks, or shares of the distinct blocks like 5%% "
        f"(default {DEFAULT_CAPACITIES} for a trace, "
        f"{DEFAULT_SYNTHETIC_CAPACITIES.replace('%', '%%')} for --synthetic)",
    )  # fmt: skip
    p.add_argument(
        "--policy", type=_policy_list, default=None,
        help=f"eviction policies to compare, comma separated, e.g. lru,arc,{DEFAULT_POLICY} "
        f"(default: KVTIER_POLICY, else {DEFAULT_POLICY}); lru always runs as the baseline of the ratios",
    )  # fmt: skip
    p.add_argument("--limit", type=_int_at_least(1), default=None, help="replay only the first N requests")
    p.add_argument(
        "--store-chunk", metavar="N|mixed", type=_store_chunk, default=None,
        help="store each request's missed blocks N at a time, as an engine that prefills in chunks or "
        "stores decoded blocks one by one does, or 'mixed': a prefill in 16-block chunks, then one block "
        "per store for the blocks its output fills (default: one store per request)",
    )  # fmt: skip
    p.add_argument("--no-belady", action="store_true", help="skip the Belady reference")
    p.add_argument(
        "--fs-root", default=None,
        help="also cascade to an fs tier under this directory (one subdirectory per run; real bytes of "
        "small blocks); per-tier hit rates",
    )  # fmt: skip
    p.add_argument("--shm-dir", default=None, help="directory of the CPU region (default: KVTIER_SHM_DIR, /dev/shm)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the sweep as JSON")
    p.set_defaults(func=_cmd_replay)


def _store_chunk(text: str) -> int | str:
    """An argparse type: ``mixed``, or a number of blocks >= 1."""
    if text == "mixed":
        return text
    try:
        return _int_at_least(1)(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: give a number of blocks per store or 'mixed'") from None


def _cmd_replay(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvtier.workload.replay import compare_policies, decode_blocks, replay_namespace, store_mode, trace_keys
    from kvtier.workload.report import replay_rows, replay_table, write_json
    from kvtier.workload.simulate import HitRateResult, belady_hit_rate, unbounded_hit_rate
    from kvtier.workload.synthetic import generate
    from kvtier.workload.trace import FlatTrace, read_trace, trace_summary

    if (args.trace is None) == (args.synthetic is None):
        raise ConfigError("give a trace file or --synthetic KIND (one of them)")
    settings = load_config(cli={"policy": args.policy[0] if args.policy else None, "shm_dir": args.shm_dir})
    args.policy, args.shm_dir = args.policy or [settings.policy], settings.shm_dir  # env < flags
    if args.json:
        check_output_file(args.json, "--json")
    if args.synthetic is not None:
        requests = generate(args.synthetic, args.requests, args.seed)
        source = f"synthetic {args.synthetic} (seed {args.seed})"
        if args.limit is not None:
            requests = requests[: args.limit]
    else:
        requests = read_trace(args.trace, limit=args.limit)
        source = f"trace {args.trace}"
    if not requests:
        raise ConfigError(f"{source} holds no requests")
    summary = trace_summary(requests)
    spec = args.capacity or _capacity_list(
        DEFAULT_SYNTHETIC_CAPACITIES if args.synthetic is not None else DEFAULT_CAPACITIES
    )
    distinct = int(summary["distinct_blocks"])
    capacities = list(dict.fromkeys(v if isinstance(v, int) else max(1, round(v * distinct)) for v in spec))
    flat = FlatTrace.from_requests(requests)
    unbounded = unbounded_hit_rate(flat)
    namespace = replay_namespace()
    keys = trace_keys(flat, namespace)
    fs_root = args.fs_root

    def tiers(policy: str, capacity: int) -> list[dict[str, Any]]:
        if fs_root is None:
            return []
        return [{"type": "fs", "root": os.path.join(fs_root, f"{policy.replace(':', '_')}-{capacity}")}]

    err = _stderr_console()
    runs = compare_policies(
        keys, capacities, args.policy, namespace=namespace, tiers=tiers, shm_dir=args.shm_dir,
        store_chunk=args.store_chunk, decode_blocks=decode_blocks(requests),
        announce=lambda p, c: err.print(f"replaying {summary['requests']} requests with {c} CPU blocks ({p})..."),
    )  # fmt: skip
    belady: dict[int, HitRateResult | None] = {
        c: None if args.no_belady else belady_hit_rate(flat, c) for c in capacities
    }
    out = Console(width=max(120, Console().width))
    out.print(
        f"{source}: {summary['requests']} requests, {summary['block_refs']} block references, "
        f"{summary['distinct_blocks']} distinct blocks, {summary['duration_s']:.0f} s"
        + store_mode(args.store_chunk),
        highlight=False,
    )
    out.print(f"unbounded cache prefix-hit rate: {100 * unbounded.hit_rate:.1f}%")
    rows = replay_rows(runs, args.policy, belady, unbounded)
    named = f"policy {args.policy[0]}" if len(args.policy) == 1 else f"policies {', '.join(args.policy)}"
    out.print(replay_table(rows, f"prefix-hit rate vs CPU capacity ({named})"))
    single = len(args.policy) == 1
    for row in rows:
        bel = row["belady"]
        belady_text = "-" if bel is None else f"{100 * bel['hit_rate']:.2f}%"
        for name in args.policy:
            kv = row["policies"][name]
            out.print(
                f"capacity {row['capacity']}: {'kvtier' if single else name} {100 * kv['hit_rate']:.2f}%  "
                f"belady {belady_text}  unbounded {100 * row['unbounded']['hit_rate']:.2f}%  "
                f"({kv['ratio_to_lru']:.3f}x lru, {kv['self_evictions']} self-evicted)",
                highlight=False,
            )
    if args.json:
        what = {"synthetic": args.synthetic, "seed": args.seed} if args.synthetic else {"trace": args.trace}
        write_json(args.json, {**what, "summary": summary, "policy": args.policy[0], "policies": args.policy,
                               "store_chunk": args.store_chunk, "rows": rows})  # fmt: skip
        err.print(f"wrote {args.json}")
    return 0


# --------------------------------------------------------------------------- sweep-shm / inspect


def _resolved_shm_dir(args: argparse.Namespace) -> str:
    """``shm_dir`` by the usual precedence (--config file < KVTIER_SHM_DIR < --shm-dir); must be a directory."""
    shm_dir = load_config(args.config, cli={"shm_dir": args.shm_dir}).shm_dir
    if not Path(shm_dir).is_dir():
        raise ConfigError(f"shm_dir {shm_dir!r} is not a directory: pass --shm-dir or set KVTIER_SHM_DIR")
    return shm_dir


def _add_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", metavar="FILE", default=None,
        help="kvtier config file (YAML/TOML/JSON); KVTIER_* environment variables and flags override it",
    )  # fmt: skip


def _add_sweep(sub: Any) -> None:
    p = sub.add_parser(
        "sweep-shm",
        help="list (and remove) stale kvtier regions of dead processes",
        description="Lists kvtier shared-memory regions of this user that no live process holds (flock "
        "proof); --remove deletes them. Regions of live processes are never touched. Entries named like "
        "regions that are not (symlinks, FIFOs, devices, other users' or header-less files) are listed as "
        "ignored, with the reason, and never opened or deleted.",
    )
    p.add_argument("--remove", action="store_true", help="delete the stale regions found")
    p.add_argument("--shm-dir", default=None, help="directory to sweep (default: the config's shm_dir, /dev/shm)")
    _add_config_flag(p)
    p.set_defaults(func=_cmd_sweep_shm)
    p = sub.add_parser(
        "sweep",
        help="list (and remove) everything dead kvtier processes left: shm regions, bench temp dirs",
        description="Lists kvtier shared-memory regions and `kvtier bench` temporary fs-tier directories "
        "whose owner died (kill -9 included): a lock the kernel drops with the process proves it. --remove "
        "deletes them. Nothing a live process holds, nothing of another user and no symlink is ever touched.",
    )
    p.add_argument("--remove", action="store_true", help="delete what was found")
    p.add_argument("--shm-dir", default=None, help="regions directory (default: the config's shm_dir, /dev/shm)")
    p.add_argument("--tmp-dir", default=None, help="where bench temp dirs live (default: the system temp dir)")
    _add_config_flag(p)
    p.set_defaults(func=_cmd_sweep)


def _sweep_regions(shm_dir: str, remove: bool) -> int:
    """Print the stale regions in ``shm_dir`` (removing them with ``remove``); returns how many."""
    from kvtier.region import SharedRegion

    result = SharedRegion.sweep(shm_dir, remove=remove)
    for r in result.stale:
        state = "removed" if r.removed else "stale"
        print(f"{state:8} {format_size(r.size):>10}  {r.path}")
    for entry in result.ignored:
        print(f"{'ignored':8} {'':>10}  {entry.path}: {entry.reason}")
    if not result.stale:
        print(f"no stale kvtier regions in {shm_dir}")
    else:
        total = sum(r.size for r in result.stale)
        verb = "removed" if remove else "found (use --remove to delete)"
        print(f"{len(result.stale)} stale region(s), {format_size(total)} {verb}")
    if result.ignored:
        print(f"{len(result.ignored)} entr{'y' if len(result.ignored) == 1 else 'ies'} named like regions "
              "ignored (not kvtier regions of this user; never opened or removed)")
    return len(result.stale)


def _cmd_sweep_shm(args: argparse.Namespace) -> int:
    _sweep_regions(_resolved_shm_dir(args), args.remove)
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    import tempfile

    from kvtier.tempdir import sweep_stale_temp_dirs
    from kvtier.workload.bench import TEMP_DIR_PREFIX

    shm_dir = _resolved_shm_dir(args)
    tmp_dir = args.tmp_dir or tempfile.gettempdir()
    if not Path(tmp_dir).is_dir():
        raise ConfigError(f"--tmp-dir {tmp_dir!r} is not a directory")
    _sweep_regions(shm_dir, args.remove)
    found = sweep_stale_temp_dirs(TEMP_DIR_PREFIX, tmp_dir, remove=args.remove)
    if not found:
        print(f"no stale kvtier bench directories in {tmp_dir}")
        return 0
    for d in found:
        state = "removed" if d.removed else "stale"
        print(f"{state:8} {format_size(d.size):>10}  {d.path}")
    verb = "removed" if args.remove else "found (use --remove to delete)"
    print(f"{len(found)} stale bench dir(s), {format_size(sum(d.size for d in found))} {verb}")
    return 0


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="summarize an fs tier directory or an S3 tier prefix: namespaces, blocks, bytes, corrupt entries",
        description="Summarizes an fs tier root or an S3 prefix offline (no engine needed). --verify reads every "
        "value and checks its header and checksum; --sample N checks N random blocks per namespace (S3).",
    )
    p.add_argument(
        "dir",
        help="the fs tier's root directory (or one namespace directory in it), or an S3 prefix: "
        "s3://bucket/prefix or http(s)://[key:secret@]host:port/bucket/prefix",
    )
    p.add_argument("--verify", action="store_true", help="read and check every value (reads every byte)")
    p.add_argument(
        "--sample", type=_int_at_least(1), default=None, metavar="N", help="S3: read and check N random blocks"
    )
    p.add_argument("--remove-corrupt", action="store_true", help="with --verify/--sample: delete corrupt values")
    p.add_argument("--namespace", default=None, help="only this namespace digest (hex prefix)")
    p.add_argument("--region", default=None, help="S3: the bucket's region (default AWS_REGION or us-east-1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_cmd_inspect)


def _inspect_s3(args: argparse.Namespace) -> Any:
    from kvtier.tiers.options import validate_options
    from kvtier.tiers.s3_inspect import inspect_prefix, options_from_url
    from kvtier.tiers.s3_store import S3TierOptions

    spec = options_from_url(args.dir, **({"region": args.region} if args.region else {}))
    return inspect_prefix(
        validate_options(S3TierOptions, "s3", spec),
        namespace=args.namespace,
        verify=args.verify,
        sample=args.sample,
        remove_corrupt=args.remove_corrupt and (args.verify or bool(args.sample)),
    )


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvtier.tiers.fs import verify_root

    is_s3 = args.dir.startswith(("s3://", "http://", "https://"))
    if args.sample is not None and not is_s3:
        raise ConfigError("--sample applies to S3 prefixes; for an fs root use --verify")
    if is_s3:
        report = _inspect_s3(args)
    else:
        report = verify_root(
            args.dir,
            namespace=args.namespace,
            check_payloads=args.verify,
            remove_corrupt=args.remove_corrupt and args.verify,
        )
    checked = args.verify or bool(args.sample)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0 if report.ok else 1
    print(f"{'s3' if is_s3 else 'fs'} tier {report.root}: {len(report.namespaces)} namespace(s)")
    for ns in report.namespaces:
        info = ns.to_dict()
        print(f"  namespace {ns.digest}")
        print(f"    model:        {info.get('model_id') or '?'}")
        print(f"    block bytes:  {info.get('block_bytes') or '?'}")
        print(f"    blocks:       {ns.entries}")
        print(f"    bytes:        {format_size(ns.bytes)} ({ns.bytes})")
        if checked:
            print(f"    verified:     {ns.verified}")
            print(
                f"    corrupt:      {len(ns.corrupt)}"
                + (f" ({ns.removed_corrupt} removed)" if ns.removed_corrupt else "")
            )
            for c in ns.corrupt[:20]:
                print(f"      {c.path}: {c.reason}")
            if len(ns.corrupt) > 20:
                print(f"      ... {len(ns.corrupt) - 20} more")
        if ns.manifest_error:
            print(f"    manifest:     {ns.manifest_error}")
        if ns.foreign_files:
            print(f"    foreign files: {len(ns.foreign_files)}")
        if ns.unsafe_entries:
            print(f"    unsafe entries: {len(ns.unsafe_entries)} (not regular files of this user: never opened)")
            for c in ns.unsafe_entries[:20]:
                print(f"      {c.path}: {c.reason}")
        if ns.temp_files_stale or ns.temp_files_live:
            print(f"    temp files:   {ns.temp_files_live} live, {ns.temp_files_stale} stale")
    print(
        f"total: {report.entries} blocks, {format_size(report.bytes)}"
        + (f", {report.corrupt} corrupt" if checked else "")
    )
    return 0 if report.ok else 1


# --------------------------------------------------------------------------- config


def _add_config(sub: Any) -> None:
    p = sub.add_parser("config", help="show the resolved configuration, its reference or schema")
    csub = p.add_subparsers(dest="config_command", metavar="{show,reference,schema}")
    csub.required = True
    show = csub.add_parser(
        "show",
        help="print the resolved config (file < KVTIER_* env < flags) with derived sizes",
        description="Resolves the configuration from --config FILE, KVTIER_<FIELD> environment "
        "variables and the flags below (same names), and prints it with bytes per block and blocks per tier.",
    )
    show.add_argument("--config", metavar="FILE", default=None, help="YAML, TOML or JSON config file")
    for name, info in KvtierConfig.model_fields.items():
        show.add_argument(cli_flag(name), dest=f"field_{name}", default=None, metavar="VALUE",
                          help=info.description)  # fmt: skip
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=_cmd_config_show)
    ref = csub.add_parser("reference", help="print the configuration reference (Markdown)")
    ref.add_argument("--output", metavar="FILE", default=None, help="write to FILE instead of stdout")
    ref.set_defaults(func=_cmd_config_reference)
    schema = csub.add_parser("schema", help="print the JSON schema of the configuration")
    schema.set_defaults(func=_cmd_config_schema)


def _cmd_config_show(args: argparse.Namespace) -> int:
    cli = {k.removeprefix("field_"): v for k, v in vars(args).items() if k.startswith("field_") and v is not None}
    config = load_config(args.config, cli=cli)
    info = describe_config(config)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    geo = info["geometry"]
    cpu = info["cpu"]
    print(f"model:           {config.model} ({info['model_id']})")
    print(f"namespace:       {info['namespace']}")
    print(
        f"geometry:        {geo['num_layers']} layers x {geo['num_kv_heads']} KV heads x {geo['head_dim']} dim, "
        f"{geo['dtype']}, kv_factor {geo['kv_factor']}, {geo['tokens_per_block']} tokens/block"
    )
    print(f"bytes per token: {info['bytes_per_token']}")
    print(f"bytes per block: {info['bytes_per_block']} ({info['block_size']}); row stride {info['row_stride']}")
    print(
        f"cpu tier:        {cpu['blocks']} blocks = {cpu['tokens']} tokens, region {cpu['region_size']} "
        f"in {cpu['shm_dir']}, policy {cpu['policy']}"
    )
    if not info["tiers"]:
        print("secondary tiers: none")
    for i, tier in enumerate(info["tiers"], start=1):
        opts = ", ".join(f"{k}={v}" for k, v in tier["options"].items())
        size = (
            f"{tier['blocks']} blocks in {tier['capacity']}" if tier["blocks"] is not None else "capacity: tier default"
        )
        print(f"tier {i}:          {tier['type']} ({opts}); {size}")
    print()
    print("settings (default < --config file < KVTIER_* environment < flags):")
    width = max(len(name) for name in info["config"])
    for name, value in info["config"].items():
        if name == "geometry":  # only the fields given; the rest come from the model preset
            value = {k: v for k, v in value.items() if v is not None}
        print(f"  {name:<{width}} = {json.dumps(value)}  ({info['sources'][name]})")
    return 0


def _cmd_config_reference(args: argparse.Namespace) -> int:
    text = render_config_reference()
    if args.output:
        check_output_file(args.output, "--output")
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_config_schema(args: argparse.Namespace) -> int:
    print(json.dumps(KvtierConfig.model_json_schema(), indent=2))
    return 0


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="Tiered KV-cache offloading: bench, trace replay, inspection and maintenance.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="{bench,replay,sweep,sweep-shm,inspect,config}")
    sub.required = True
    _add_bench(sub)
    _add_replay(sub)
    _add_sweep(sub)
    _add_inspect(sub)
    _add_config(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvtier`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KvtierError as exc:
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvtier {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly, without a second error at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    except OSError as exc:
        # The environment refused something (a permission, a full disk, a port in use).
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
