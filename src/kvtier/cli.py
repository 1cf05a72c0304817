"""The ``kvtier`` command.

Subcommands:

* ``kvtier bench``: a multi-turn chat workload through the whole stack with real
  bytes (CPU tier in /dev/shm + an fs tier in a lock-held temp dir by default).
* ``kvtier replay TRACE.jsonl`` (or ``--synthetic KIND``): metadata-only replay of
  a Mooncake trace or a generated workload through the real manager, hit rate per
  policy and capacity (blocks, shares or sizes) with its ratio to LRU, beside
  unbounded and Belady references; ``--plot`` draws it, ``--json -`` prints it.
* ``kvtier sweep [--remove]``: everything dead kvtier processes left (stale
  regions, bench temp dirs); ``kvtier sweep-shm`` the regions only.
* ``kvtier inspect DIR|S3-URL [--verify|--sample N]``: summary of an fs tier directory or an S3 prefix.
* ``kvtier config show|reference|schema``: the resolved configuration and its sizes.
* ``kvtier fleet serve --engine NAME=tcp://HOST:PORT ...``: a prefix index over engines' KV
  events, answering routers over HTTP (:mod:`kvtier.fleet`).

Settings resolve as default < ``--config FILE`` < ``KVTIER_*`` environment <
flags for every command that reads them. Inputs are checked before any work
(numbers at parse time, against their bounds; output paths, flag combinations,
memory and optional dependencies before a run); no flag is silently ignored:
an empty value, or a flag that does not apply to what else was given, is refused.
Files are read and written by :mod:`kvtier.user_files` (regular files only,
size caps, UTF-8 positions; outputs written in place, ``-`` for stdout).

Exit status, for every command: 0 success; 1 the command ran and found a problem
(wrong bytes loaded, a failed copy or tier job, corrupt entries); 2 bad usage,
configuration or environment (the message names the input and the fix).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from kvtier.config import (
    KvtierConfig,
    cli_flag,
    describe_config,
    format_size,
    load_config,
    parse_size,
    render_config_reference,
)
from kvtier.config.schema import MAX_LAYOUT_COUNT
from kvtier.errors import ConfigError, KvtierError, exception_text
from kvtier.fleet.cli import add_fleet_parser
from kvtier.interrupts import DeferredReleases, Terminated, interrupts_deferred, raising_interrupts
from kvtier.units import comma_entries, shown
from kvtier.user_files import STDOUT, OutputFile, check_output, os_error_text, write_output
from kvtier.validation import is_utf8_text
from kvtier.version import __version__

logger = logging.getLogger("kvtier.cli")

_DEFAULT_POLICY = str(KvtierConfig.model_fields["policy"].default)

DEFAULT_CAPACITIES = "1000,5000,9139,20000,50000"


MAX_COUNT = 1 << 31
"""The largest count any flag takes where no tighter bound is stated."""
_MAX_DIGITS = 30


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _hex_prefix(text: str) -> str:
    """``inspect --namespace``: a namespace digest or its start, in hex (a digest is 32 hex digits)."""
    if not 0 < len(text) <= 32 or any(c not in "0123456789abcdef" for c in text.lower()):
        raise argparse.ArgumentTypeError(f"expected a namespace digest or its start (1-32 hex digits), got {text!r}")
    return text.lower()


def _positive_size(text: str) -> int:
    size = _size(text)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive, e.g. '256MiB'")
    return size


def _int_in(low: int, high: int = MAX_COUNT) -> Callable[[str], int]:
    """An argparse type: an integer in [``low``, ``high``], refused at parse time (exit 2) otherwise."""

    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-")
        if len(digits) > _MAX_DIGITS and digits.isdigit():
            raise argparse.ArgumentTypeError(f"a number of {len(digits)} digits: must be at most {high}")
        try:
            if not text.isascii():  # (int() reads other scripts' digits: '١٢' is 12)
                raise ValueError(text)
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value

    return parse


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low`` (and at most :data:`MAX_COUNT`)."""
    return _int_in(low)


def _prefill_rate(text: str) -> float:
    """``--prefill-tokens-per-s``: 0 (instantaneous) or a finite rate in [MIN_PREFILL_RATE, MAX_PREFILL_RATE]."""
    from kvtier.workload.bench import MAX_PREFILL_RATE, MIN_PREFILL_RATE

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
    if not (value == 0 or MIN_PREFILL_RATE <= value <= MAX_PREFILL_RATE):
        raise argparse.ArgumentTypeError(
            f"must be a finite number: 0 (instantaneous) or {MIN_PREFILL_RATE:g} to {MAX_PREFILL_RATE:g} "
            f"tokens/s, got {shown(text)}"
        )
    return value


def _port(text: str) -> int:
    value = _int_in(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535] (0 = any free port), got {value}")
    return value


def check_output_file(path: str, flag: str, inputs: Sequence[str | None] = ()) -> None:
    """Refuse, before any work, an output path that cannot be written (exit 2); see :func:`check_output`."""
    check_output(path, flag, inputs)


def check_plot_file(path: str, inputs: Sequence[str | None] = ()) -> None:
    """Refuse ``--plot`` before the run (ConfigError, one line naming ``--plot`` and png, svg and
    pdf) when matplotlib is missing or the file type is not one :func:`plot_image` writes here
    without an external program (``pgf``) or a warning (``ps``/``eps``): a type matplotlib knows is
    test-rendered in memory (:func:`kvtier.workload.report.plot_format_problem`), one it does not
    know is refused at once."""
    check_output(path, "--plot", inputs)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed: pip install 'kvtier[plot]'") from None
    if path == STDOUT:
        return  # PNG
    from kvtier.workload.report import plot_format_problem

    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in kinds:
        what = repr(suffix) if suffix else "a file without a suffix"
        # Named without test-rendering every type (seconds on a loaded host): png, svg and pdf are
        # matplotlib's own renderers, always quiet here; a rarer type chosen is checked when given.
        raise ConfigError(f"--plot {path!r}: matplotlib cannot write {what}: use the suffix 'png', 'svg' or 'pdf' "
                          f"(matplotlib's types: {', '.join(kinds)})")  # fmt: skip
    problem = plot_format_problem(suffix)  # renders a tiny plot: pgf needs LaTeX, ps/eps warn
    if problem is not None:
        raise ConfigError(
            f"--plot {path!r}: cannot write {suffix!r} here ({problem}): use the suffix 'png', 'svg' or 'pdf'"
        )


def _same_file(a: str, b: str) -> bool:
    """Whether two output paths name one file: the same path once resolved, or the same inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _open_outputs(
    stack: contextlib.ExitStack, outputs: dict[str, str | None], inputs: Sequence[str | None]
) -> dict[str, OutputFile]:
    """Check every output flag given (``{"--json": path, ...}``) before the work; at most one may be
    ``-`` (stdout). Returns an :class:`OutputFile` per flag given, closed with ``stack``."""
    to_stdout = [flag for flag, path in outputs.items() if path == STDOUT]
    if len(to_stdout) > 1:
        raise ConfigError(f"{' and '.join(to_stdout)} both write to standard output ('-'): give one of them a file")
    named = [(flag, path) for flag, path in outputs.items() if path is not None and path != STDOUT]
    for i, (flag, target) in enumerate(named):
        for other, other_target in named[:i]:
            if _same_file(target, other_target):
                raise ConfigError(
                    f"{other} {other_target!r} and {flag} {target!r} name the same file: give each its own"
                )
    opened: dict[str, OutputFile] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        if flag == "--plot":
            check_plot_file(path, inputs)
        opened[flag] = stack.enter_context(OutputFile(path, flag, inputs))
    return opened


def _stderr_console() -> Any:
    from kvtier.workload.textout import text_console

    return text_console(stderr=True)


def _say(console: Any, text: str) -> None:
    """One line to ``console`` as is: no markup, no highlighting, no hard wrapping."""
    console.print(text, soft_wrap=True, highlight=False, markup=False)


# --------------------------------------------------------------------------- bench


def _add_bench(sub: Any) -> None:
    from kvtier.workload.bench import (
        DEFAULT_BENCH_CPU_BYTES,
        DEFAULT_BENCH_FS_BYTES,
        DEFAULT_BENCH_MODEL,
        MAX_DEVICE_BLOCKS,
    )

    p = sub.add_parser(
        "bench",
        help="run a multi-turn chat workload through the tiers with real bytes",
        description=(
            "Run a deterministic multi-turn chat workload through kvtier: a simulated device KV pool, "
            "the CPU tier in /dev/shm and an fs tier (temp dir unless --fs-root), moving and verifying "
            "real bytes. Prints hit rates per tier, bandwidth, scheduler-side latency and prefill saved. "
            "Settings resolve as bench defaults < --config file < KVTIER_* environment < flags. "
            "Counts are bounded and the run's memory (device pool, CPU tier, workload) is checked against "
            "the memory available before anything is allocated. "
            "Exit status: 0 success, 1 a loaded block had wrong bytes or a copy/tier job failed (a line "
            "says which and why), 2 bad usage, configuration or environment."
        ),
    )
    _add_bench_workload(p.add_argument_group("workload"))
    s = p.add_argument_group("sizes and tiers")
    s.add_argument(
        "--config", metavar="FILE", action=_TierFlag, default=None,
        help="bench this kvtier config (YAML/TOML/JSON): its CPU size, policy, model, geometry and tiers; "
        "KVTIER_* environment variables and the flags below override it; --fs-root/--redis/--s3/--memory-tier "
        "add tiers, which cascade in the order the flags are given (the config's tiers at --config's place)",
    )  # fmt: skip
    s.add_argument("--model", metavar="PRESET", default=None, help=f"model preset (default {DEFAULT_BENCH_MODEL})")
    s.add_argument("--tokens-per-block", type=_int_in(1, MAX_LAYOUT_COUNT), metavar="N", default=None,
                   help="tokens per KV block (default 16)")  # fmt: skip
    s.add_argument(
        "--cpu-bytes", type=_positive_size, metavar="SIZE", default=None,
        help=f"CPU tier size (default {format_size(DEFAULT_BENCH_CPU_BYTES)})",
    )  # fmt: skip
    s.add_argument("--device-blocks", type=_int_in(1, MAX_DEVICE_BLOCKS), metavar="N", default=512,
                   help="simulated device pool, blocks (default 512; must fit in the memory available)")  # fmt: skip
    s.add_argument("--policy", metavar="NAME", default=None,
                   help=f"CPU tier eviction policy (default {_DEFAULT_POLICY}, as in any configuration)")  # fmt: skip
    s.add_argument("--shm-dir", metavar="DIR", default=None, help="directory of the CPU region (default /dev/shm)")
    s.add_argument(
        "--fs-root", metavar="DIR", action=_TierFlag, default=None,
        help="fs tier directory (kept); default: a lock-held temp dir, removed after (none if the config has tiers)",
    )  # fmt: skip
    s.add_argument(
        "--fs-bytes", type=_positive_size, metavar="SIZE", default=None,
        help=f"fs tier capacity (default {format_size(DEFAULT_BENCH_FS_BYTES)})",
    )  # fmt: skip
    s.add_argument("--no-fs", action="store_true",
                   help="run without the bench's fs tier (not with --fs-root/--fs-bytes)")  # fmt: skip
    s.add_argument("--redis", metavar="URL", action=_TierFlag, default=None,
                   help="add a redis tier, e.g. redis://127.0.0.1:6379/0")  # fmt: skip
    s.add_argument(
        "--s3", metavar="URL", action=_TierFlag, default=None,
        help="add an S3 tier: s3://bucket/prefix (AWS) or http(s)://[key:secret@]host:port/bucket/prefix",
    )  # fmt: skip
    s.add_argument(
        "--memory-tier", metavar="SIZE", nargs="?", action=_TierFlag, const="256MiB", default=None,
        type=_positive_size,
        help="add the in-process reference memory tier (default size 256MiB)",
    )  # fmt: skip
    s.add_argument(
        "--strict", action="store_true",
        help="a configured tier that is unreachable (circuit breaker open) is an error (exit 2)",
    )  # fmt: skip
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", default=None,
                   help="write the full result as JSON ('-': stdout, the tables then go to stderr)")  # fmt: skip
    o.add_argument("--plot", metavar="FILE.png", default=None,
                   help="plot hit rate over time and bytes per tier ('-': PNG to stdout)")  # fmt: skip
    o.add_argument("--metrics-port", type=_port, metavar="PORT", default=None,
                   help="serve Prometheus metrics while running")  # fmt: skip
    o.add_argument("--metrics-addr", metavar="ADDR", default=None,
                   help="address for --metrics-port (default 127.0.0.1)")  # fmt: skip
    o.add_argument("--no-progress", action="store_true", help="no progress bar (none is shown when not on a terminal)")
    p.set_defaults(func=_cmd_bench)


class _TierFlag(argparse._StoreAction):
    """A flag that adds tiers (``--config``, ``--fs-root``, ``--redis``, ``--s3``, ``--memory-tier``): stores
    its value and records where it came on the command line (``tier_order``), so tiers are built in the
    order the user gave them. A flag given twice takes its last value and place."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        super().__call__(parser, namespace, values, option_string)
        order = [d for d in getattr(namespace, "tier_order", None) or [] if d != self.dest]
        namespace.tier_order = [*order, self.dest]


def _add_bench_workload(w: Any) -> None:
    """The bench's workload flags (every count bounded, see kvtier.workload.chat)."""
    from kvtier.workload.bench import MAX_BATCH_SIZE
    from kvtier.workload.chat import MAX_SEED, MAX_SESSIONS, MAX_SHARED_PROMPTS, MAX_TURNS

    turns = _int_in(1, MAX_TURNS)
    w.add_argument("--sessions", type=_int_in(1, MAX_SESSIONS), metavar="N", default=48,
                   help=f"chat sessions (default 48, at most {MAX_SESSIONS})")  # fmt: skip
    w.add_argument("--min-turns", type=turns, metavar="N", default=2,
                   help="turns per session, lower bound (default 2)")  # fmt: skip
    w.add_argument("--max-turns", type=turns, metavar="N", default=6,
                   help=f"turns per session, upper bound (default 6, at most {MAX_TURNS})")  # fmt: skip
    w.add_argument("--shared-prompts", type=_int_in(0, MAX_SHARED_PROMPTS), metavar="N", default=4,
                   help=f"shared system prompts (default 4, at most {MAX_SHARED_PROMPTS})")  # fmt: skip
    w.add_argument("--seed", type=_int_in(0, MAX_SEED), metavar="N", default=0, help="workload seed (default 0)")
    w.add_argument("--batch-size", type=_int_in(1, MAX_BATCH_SIZE), metavar="N", default=4,
                   help="requests admitted per engine step (default 4)")  # fmt: skip
    w.add_argument(
        "--prefill-tokens-per-s", type=_prefill_rate, metavar="TOKENS", default=25_000.0,
        help="simulated device prefill speed; 0 = instantaneous, else 1 to 1e12 (default 25000)",
    )  # fmt: skip


def _bench_config(args: argparse.Namespace) -> KvtierConfig:
    """The bench's configuration: bench defaults < --config file < KVTIER_* environment < flags."""
    from kvtier.workload.bench import BENCH_DEFAULTS

    flags: dict[str, Any] = {
        "cpu_bytes": args.cpu_bytes, "policy": args.policy, "model": args.model, "shm_dir": args.shm_dir,
        "geometry": None if args.tokens_per_block is None else {"tokens_per_block": args.tokens_per_block},
    }  # fmt: skip
    return load_config(args.config, cli=flags, cli_flags={"geometry": "--tokens-per-block"}, defaults=BENCH_DEFAULTS,
                       defaults_source="kvtier bench default")  # fmt: skip


def _extra_bench_tiers(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Tiers added by --s3 and --memory-tier, by flag dest."""
    tiers: dict[str, dict[str, Any]] = {}
    if args.s3:
        from kvtier.tiers.s3_inspect import options_from_url

        tiers["s3"] = {"type": "s3", **options_from_url(args.s3)}
    if args.memory_tier is not None:
        tiers["memory_tier"] = {"type": "memory", "max_bytes": args.memory_tier}
    return tiers


_TIER_GROUPS = {"config": "config", "fs_root": "fs", "redis": "redis"}
"""The bench's tier groups by the dest of the flag that adds them (BenchOptions.tier_order)."""


def _bench_tier_order(args: argparse.Namespace, extra: list[str]) -> tuple[str | int, ...]:
    """Tier groups in the order their flags came; tiers from no flag first (KVTIER_TIERS's, the temp fs)."""
    given = list(getattr(args, "tier_order", None) or [])
    order: list[str | int] = [group for group, dest in (("config", "config"), ("fs", "fs_root")) if dest not in given]
    for dest in given:
        order.append(extra.index(dest) if dest in extra else _TIER_GROUPS[dest])
    return tuple(order)


def _check_bench_flags(args: argparse.Namespace, own_tiers: bool) -> None:
    """Refuse flags that the rest of the command line would make the bench ignore (exit 2)."""
    if args.min_turns > args.max_turns:
        raise ConfigError(f"--min-turns {args.min_turns} is above --max-turns {args.max_turns}: lower or raise one")
    if args.no_fs:
        fs_flags = (("--fs-root", args.fs_root), ("--fs-bytes", args.fs_bytes))
        given = [flag for flag, value in fs_flags if value is not None]
        if given:
            raise ConfigError(f"--no-fs runs without the fs tier that {' and '.join(given)} set up: drop one of them")
    elif args.fs_bytes is not None and args.fs_root is None and own_tiers:
        raise ConfigError(
            "--fs-bytes sizes the bench's fs tier, which is not added because the configuration names its own "
            "tiers: add --fs-root DIR to add it, or drop --fs-bytes"
        )
    if args.metrics_addr is not None and args.metrics_port is None:
        raise ConfigError("--metrics-addr needs --metrics-port PORT (no metrics are served without it)")
    if args.metrics_addr is not None and not is_utf8_text(args.metrics_addr):
        raise ConfigError(f"--metrics-addr {args.metrics_addr!r:.80} holds bytes that are not UTF-8: give an "
                          "address of this machine, e.g. 127.0.0.1 or ::1")  # fmt: skip


def _bench_options(args: argparse.Namespace, config: KvtierConfig) -> Any:
    from kvtier.workload.bench import DEFAULT_BENCH_FS_BYTES, BenchOptions
    from kvtier.workload.chat import ChatWorkloadSpec

    own_tiers = config.sources["tiers"] != "default"
    _check_bench_flags(args, own_tiers)
    extra = _extra_bench_tiers(args)
    extra = {dest: extra[dest] for dest in [*(getattr(args, "tier_order", None) or []), *extra] if dest in extra}
    workload = ChatWorkloadSpec(
        sessions=args.sessions,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        shared_system_prompts=args.shared_prompts,
        seed=args.seed,
    )
    return BenchOptions(
        workload=workload,
        device_blocks=args.device_blocks,
        fs=not args.no_fs and (args.fs_root is not None or not own_tiers),
        fs_root=args.fs_root,
        fs_bytes=args.fs_bytes if args.fs_bytes is not None else DEFAULT_BENCH_FS_BYTES,
        redis_url=args.redis,
        extra_tiers=list(extra.values()),
        tier_order=_bench_tier_order(args, list(extra)),
        batch_size=args.batch_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        base_config=config,
        strict=args.strict,
    )


def _run_bench_showing_progress(options: Any, metrics: Any, err: Any, show: bool) -> Any:
    """Run the bench; a progress bar on stderr when ``show`` and stderr is a terminal, tier events as lines."""
    from kvtier.workload.bench import run_bench
    from kvtier.workload.progress import RequestProgress

    with RequestProgress(err, None, description="requests", enabled=show) as bar:

        def notify(line: str) -> None:
            bar.say(f"kvtier bench: {line}")

        def progress(done: int, total: int) -> None:
            bar.update(done, total)

        return run_bench(options, progress=progress if bar.shown else None, metrics=metrics, notify=notify)


def _cmd_bench(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:
        outputs = _open_outputs(stack, {"--json": args.json, "--plot": args.plot}, inputs=[args.config])
        return _bench(args, outputs)


def _bench(args: argparse.Namespace, outputs: dict[str, OutputFile]) -> int:
    from kvtier.metrics import KvtierMetrics
    from kvtier.workload.bench import describe_options
    from kvtier.workload.budget import check_memory
    from kvtier.workload.report import json_document, plot_image, print_bench
    from kvtier.workload.textout import text_console

    if args.fs_root is not None:  # refused before the workload is hashed and the CPU region made
        _check_fs_root_flag(args.fs_root)
    config = _bench_config(args)
    _check_shm_dir(config)
    options = _bench_options(args, config)
    options.config(options.fs_root)  # the tiers the bench adds (--redis ...) are checked before anything runs
    check_memory(options.memory_needs(options.config(None)))
    err = _stderr_console()
    _say(err, f"kvtier bench: {describe_options(options)}")
    chosen = [f"{name} ({source})" for name, source in config.sources.items() if "default" not in source]
    if chosen:
        _say(err, "kvtier bench: settings from " + ", ".join(chosen))
    metrics: KvtierMetrics | None = None
    if args.metrics_port is not None:
        addr = args.metrics_addr or "127.0.0.1"
        metrics = KvtierMetrics()
        try:
            port = metrics.serve(args.metrics_port, addr)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-port {args.metrics_port}: cannot listen on {addr}: {os_error_text(exc)}"
            ) from None
        host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr  # an IPv6 address in a URL
        _say(err, f"serving Prometheus metrics on http://{host}:{port}/metrics")
    try:
        result = _run_bench_showing_progress(options, metrics, err, show=not args.no_progress)
    finally:
        if metrics is not None:
            metrics.close()
    # With --json - or --plot -, standard output carries that document alone: the tables go to stderr.
    print_bench(result, err if STDOUT in (args.json, args.plot) else text_console())
    if "--json" in outputs:
        outputs["--json"].write(json_document(result.to_dict()))
        if args.json != STDOUT:
            _say(err, f"wrote {args.json}")
    if "--plot" in outputs:
        outputs["--plot"].write(plot_image(result, Path(args.plot).suffix.lstrip(".").lower() or "png"))
        if args.plot != STDOUT:
            _say(err, f"wrote {args.plot}")
    for line in result.error_lines():
        _say(err, f"kvtier bench: {line}")
    return 1 if result.errors else 0


def _check_shm_dir(config: KvtierConfig) -> None:
    """The CPU region's directory must be a directory (named with where the setting came from)."""
    if not Path(config.shm_dir).is_dir():
        raise ConfigError(
            f"shm_dir {config.shm_dir!r} (from {config.sources['shm_dir']}) is not a directory: give a tmpfs "
            "directory such as /dev/shm"
        )


# --------------------------------------------------------------------------- replay

DEFAULT_SYNTHETIC_CAPACITIES = "0.5%,1%,2%,5%,10%,20%"


MAX_REPLAY_CAPACITY = 1 << 28
"""The largest CPU capacity a replay takes, in blocks (its manager holds about 300 bytes a block)."""
REPLAY_BYTES_PER_BLOCK = 512
"""Memory a replay's manager and policy hold per CPU block, rounded up (docs/performance.md: ~250 B at 1M blocks)."""
MAX_SYNTHETIC_REQUESTS = 10_000_000
"""The most requests of a generated workload (about 1 KB and 100 us each to generate)."""
SYNTHETIC_BYTES_PER_REQUEST = 4096
"""Memory one generated request costs a replay, rounded up: the request, its keys, its flat ids."""
TRACE_MEMORY_FACTOR = 48
"""Memory a replay holds per byte of trace text, rounded up (requests, keys, flat ids): 25 bytes measured
on a Mooncake-like trace (6-digit chained ids), 45 on one of single-digit ids (2026-12-06)."""


def _capacity_list(text: str) -> list[Any]:
    """``--capacity``: block counts, shares of the distinct blocks (``5%``) or sizes (``4GiB``); see
    :mod:`kvtier.workload.capacity`. Refused at parse time (exit 2) naming the value as typed."""
    from kvtier.workload.capacity import parse_capacities

    try:
        return parse_capacities(text, MAX_REPLAY_CAPACITY)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _model_preset(text: str) -> str:
    """``replay --model``: a preset name (another model's trace-block size goes in --block-bytes)."""
    from kvtier.config import MODEL_PRESETS

    if text not in MODEL_PRESETS:
        raise argparse.ArgumentTypeError(
            f"{shown(text)} is not a model preset ({', '.join(MODEL_PRESETS)}): give one, or give the KV size "
            "of one trace block of your model with --block-bytes SIZE"
        )
    return text


def _policy_list(text: str) -> list[str]:
    from kvtier.policies import resolve_policy

    try:
        names = list(dict.fromkeys(comma_entries(text, "--policy")))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not names:
        raise argparse.ArgumentTypeError(f"--policy {text!r}: give policy names, e.g. lru,arc,return-time")
    for name in names:
        try:
            resolve_policy(name)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def _add_replay(sub: Any) -> None:
    """The ``replay`` command's parser. Long because it is one ``add_argument`` per flag."""
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
    p.add_argument("trace", nargs="?", default=None,
                   help="trace file (JSON lines, or gzip-compressed JSON lines); or use --synthetic")  # fmt: skip
    p.add_argument(
        "--synthetic", metavar="KIND", choices=KINDS, default=None,
        help=f"replay a generated workload instead of a trace: {', '.join(KINDS)}",
    )  # fmt: skip
    p.add_argument("--requests", type=_int_in(1, MAX_SYNTHETIC_REQUESTS), default=None,
                   help=f"requests of a generated workload (default {DEFAULT_REQUESTS}; --synthetic only)")  # fmt: skip
    p.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=None,
                   help="seed of the generated workload (default 0; --synthetic only)")  # fmt: skip
    p.add_argument(
        "--capacity", type=_capacity_list, default=None,
        help="CPU tier sizes, comma separated: a plain integer is a number of blocks (trace blocks, "
        "hash_ids), 5%% a share of the trace's distinct blocks, a number with a unit (4GiB, 512MB, 4G) a "
        "size in bytes, converted to whole blocks of the model's KV (--model or --block-bytes) "
        f"(default {DEFAULT_CAPACITIES} for a trace, "
        f"{DEFAULT_SYNTHETIC_CAPACITIES.replace('%', '%%')} for --synthetic)",
    )  # fmt: skip
    p.add_argument(
        "--model", metavar="PRESET", type=_model_preset, default=None,
        help="model whose KV the CPU tier holds (default: KVTIER_MODEL): sizes in --capacity convert with "
        "its bytes per token x --block-tokens, and capacities are shown as sizes too",
    )  # fmt: skip
    p.add_argument(
        "--block-tokens", metavar="N", type=_int_in(1, MAX_LAYOUT_COUNT), default=None,
        help="tokens per trace block (hash_id), for sizes and the decode stores of --store-chunk mixed "
        "(default 512, as in the Mooncake traces)",
    )  # fmt: skip
    p.add_argument(
        "--block-bytes", metavar="SIZE", type=_positive_size, default=None,
        help="KV bytes of one trace block, for a model that is not a preset (instead of --model)",
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
    p.add_argument(
        "--hints", action="store_true",
        help="with --synthetic: each request of a session carries the hints its client knows (kvtier_session, "
        "kvtier_session_end, kvtier_expected_return_s; docs/vllm.md 'Per-request keys'); a trace has no sessions",
    )  # fmt: skip
    p.add_argument(
        "--key-seed", type=_int_in(0, 2**31 - 1), default=0, metavar="N",
        help="derive the blocks' keys in another namespace (default 0): the same requests and reuse, other "
        "key bytes, so another draw of the keys return-time samples; a replay is one such draw, and "
        "replays under a few seeds show how much of a figure is the draw (LRU's hits do not change)",
    )  # fmt: skip
    p.add_argument("--no-belady", action="store_true", help="skip the Belady reference")
    _add_replay_fs_tier(p)
    p.add_argument("--shm-dir", default=None, help="directory of the CPU region (default: KVTIER_SHM_DIR, /dev/shm)")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write the sweep as JSON ('-': stdout, the tables then go to stderr)")  # fmt: skip
    p.add_argument(
        "--plot", metavar="FILE.png", default=None,
        help="draw hit rate against capacity per policy, with LRU, Belady and unbounded as references, and "
        "hits per tier with --fs-root (needs the plot extra: pip install 'kvtier[plot]'; '-': PNG to stdout)",
    )  # fmt: skip
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (none is shown when standard error is not a terminal)")  # fmt: skip
    p.set_defaults(func=_cmd_replay)


def _add_replay_fs_tier(p: argparse.ArgumentParser) -> None:
    """replay's flags of its optional fs tier."""
    p.add_argument(
        "--fs-root", metavar="DIR", default=None,
        help="also cascade to an fs tier on this directory's disk: each replay makes a fresh, lock-held "
        "subdirectory (kvtier-replay-*) and removes it after, so no run starts warm (real bytes of small "
        "blocks); per-tier hit rates",
    )  # fmt: skip
    p.add_argument(
        "--fs-blocks", metavar="N|P%", type=_fs_blocks, default=None,
        help="with --fs-root: the fs tier's size, in blocks or as a share of the distinct blocks like 10%% "
        "(default: the fs tier's own default, a share of the free space)",
    )  # fmt: skip
    p.add_argument("--admission", choices=("all", "learned"), default="all",
                   help="with --fs-root: which stored blocks the fs tier is given (the tier option admission)")


def _fs_blocks(text: str) -> Any:
    """``replay --fs-blocks``: one block count or share of the distinct blocks (a size is refused:
    the fs tier's blocks are trace blocks); refused at parse time naming the flag."""
    from kvtier.workload.capacity import parse_capacities

    try:
        entries = parse_capacities(text, MAX_REPLAY_CAPACITY, "--fs-blocks", sizes=False)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if len(entries) != 1:
        raise argparse.ArgumentTypeError(f"--fs-blocks {text!r}: give one block count or one share like 10%")
    if entries[0].nbytes is not None:
        raise argparse.ArgumentTypeError(
            f"--fs-blocks {text!r} is a size: give the fs tier's blocks as a count or a share of the distinct "
            "blocks, e.g. 20000 or 10%"
        )
    return entries[0]


def _store_chunk(text: str) -> int | str:
    """An argparse type: ``mixed``, or a number of blocks >= 1."""
    if text == "mixed":
        return text
    try:
        return _int_at_least(1)(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: give a number of blocks per store or 'mixed'") from None


REPLAY_DIR_PREFIX = "kvtier-replay-"
"""Name prefix of a replay's lock-held fs-tier directory under ``--fs-root`` (swept like the bench's)."""


def _replay_requests(args: argparse.Namespace) -> tuple[list[Any], str, list[Any] | None]:
    """The requests to replay, where they came from and, with ``--hints``, each one's params (the
    hints of its session); memory is checked before they are made."""
    from kvtier.workload.budget import MemoryNeed, available_memory, check_memory
    from kvtier.workload.synthetic import DEFAULT_REQUESTS, generate_with_hints
    from kvtier.workload.trace import MAX_TRACE_BYTES, read_trace

    if args.synthetic is not None:
        count = args.requests if args.requests is not None else DEFAULT_REQUESTS
        seed = args.seed if args.seed is not None else 0
        # --limit keeps the first requests of the whole workload, which is generated first
        check_memory([MemoryNeed("generated requests", count * SYNTHETIC_BYTES_PER_REQUEST, "--requests")])
        requests, hints = generate_with_hints(args.synthetic, count, seed)
        if args.limit is not None:
            requests, hints = requests[: args.limit], hints[: args.limit]
        return requests, f"synthetic {args.synthetic} (seed {seed})" + (", hints" if args.hints else ""), (
            hints if args.hints else None
        )
    if args.hints:
        raise ConfigError("--hints feeds the sessions of a generated workload (--synthetic KIND); a trace has none")
    shaping = (("--requests", args.requests), ("--seed", args.seed))
    given = [flag for flag, value in shaping if value is not None]
    if given:
        verb = "shapes" if len(given) == 1 else "shape"
        raise ConfigError(f"{' and '.join(given)} {verb} a generated workload (--synthetic KIND), not a trace: drop it")
    available = available_memory()
    cap = MAX_TRACE_BYTES if available is None else min(MAX_TRACE_BYTES, available // TRACE_MEMORY_FACTOR)
    return read_trace(args.trace, limit=args.limit, max_bytes=cap), f"trace {args.trace}", None


def _check_replay_capacity(capacities: Sequence[int], shm_dir: str) -> None:
    """The largest capacity's manager must fit in memory and its region in ``shm_dir`` (before any run)."""
    from kvtier.units import PAGE_SIZE
    from kvtier.workload.budget import MemoryNeed, check_memory

    largest = max(capacities)
    check_memory([MemoryNeed("CPU tier metadata", largest * REPLAY_BYTES_PER_BLOCK, "--capacity")])
    try:
        free = os.statvfs(shm_dir)
    except OSError as exc:
        raise ConfigError(f"shm_dir {shm_dir!r}: {os_error_text(exc)}") from None
    room = free.f_bavail * free.f_frsize
    if largest * PAGE_SIZE > room:
        raise ConfigError(
            f"--capacity {largest} needs {format_size(largest * PAGE_SIZE)} in {shm_dir} (one page a block) and "
            f"{format_size(room)} is free: lower --capacity or use --shm-dir on a larger tmpfs"
        )


def _check_fs_root_flag(fs_root: str) -> None:
    """--fs-root (bench, replay) names a directory, or nothing yet (made when the run starts), by a
    path of UTF-8 text (an fs tier's root is text: a path of other bytes was refused only once the
    first replay had started): checked before any work (the bench refused a file there only after
    hashing its workload and making its CPU region: over 30 s in a loaded CI run)."""
    if not is_utf8_text(fs_root):
        raise ConfigError(f"--fs-root {fs_root!r:.200} holds bytes that are not UTF-8, which an fs tier's root "
                          "cannot: give a directory whose path is UTF-8 text")  # fmt: skip
    if os.path.lexists(fs_root) and not os.path.isdir(fs_root):
        raise ConfigError(f"--fs-root {fs_root!r} is not a directory: give a directory (made if missing)")


def _replay_fs_dir(fs_root: str, releases: DeferredReleases) -> Any:
    """A fresh lock-held directory under ``fs_root`` for this replay's fs tiers (stale ones swept
    first), its removal registered with ``releases`` before an interrupt can land (kvtier.interrupts)."""
    from kvtier.tempdir import LockedTempDir, sweep_stale_temp_dirs
    from kvtier.tiers.fs_files import FileModes, make_dirs

    _check_fs_root_flag(fs_root)
    try:
        make_dirs(Path(fs_root), FileModes.for_group(None))  # what is missing: 0700, as the fs tier makes it
        for stale in sweep_stale_temp_dirs(REPLAY_DIR_PREFIX, fs_root, remove=True):
            logger.info("removed %s left by a replay that died", stale.path)
        with interrupts_deferred():
            scratch = LockedTempDir(REPLAY_DIR_PREFIX, fs_root)
            releases.callback(scratch.cleanup)
        return scratch
    except OSError as exc:
        raise ConfigError(f"--fs-root {fs_root!r}: {os_error_text(exc)}") from None


def _replay_fs_options(args: argparse.Namespace, distinct: int) -> dict[str, Any]:
    """The replay fs tier's options from --fs-blocks and --admission (which need --fs-root)."""
    from kvtier.tiers.fs import FilesystemTier
    from kvtier.workload.capacity import capacity_blocks
    from kvtier.workload.replay import REPLAY_BLOCK_BYTES

    if args.fs_root is None:
        given = [f for f, v in (("--fs-blocks", args.fs_blocks), ("--admission", args.admission != "all")) if v]
        if given:
            verb = "shapes" if len(given) == 1 else "shape"
            raise ConfigError(f"{' and '.join(given)} {verb} the replay's fs tier: add --fs-root DIR, or drop it")
        return {}
    options: dict[str, Any] = {"admission": args.admission}
    if args.fs_blocks is not None:
        (blocks,) = capacity_blocks([args.fs_blocks], distinct, None, MAX_REPLAY_CAPACITY, flag="--fs-blocks")
        options["max_bytes"] = blocks * FilesystemTier.bytes_per_block(REPLAY_BLOCK_BYTES)
    return options


def _cmd_replay(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:
        if (args.trace is None) == (args.synthetic is None):
            raise ConfigError("give a trace file or --synthetic KIND, one of them (see 'kvtier replay --help')")
        outputs = _open_outputs(stack, {"--json": args.json, "--plot": args.plot}, inputs=[args.trace])
        return _replay(args, outputs)


def _replay_capacities(args: argparse.Namespace, distinct: int, block: tuple[int, str] | None) -> list[int]:
    """``--capacity`` (or the default list) in blocks, in the order given; see :func:`capacity_blocks`."""
    from kvtier.workload.capacity import capacity_blocks

    block_bytes, note = block if block is not None else (None, "")
    if args.capacity:
        return capacity_blocks(args.capacity, distinct, block_bytes, MAX_REPLAY_CAPACITY, note)
    default = _capacity_list(DEFAULT_SYNTHETIC_CAPACITIES if args.synthetic is not None else DEFAULT_CAPACITIES)
    return list(dict.fromkeys(c.blocks or max(1, round((c.share or 0) * distinct)) for c in default))


def _replay_block_bytes(args: argparse.Namespace, settings: KvtierConfig) -> tuple[int, str] | None:
    """KV bytes of one trace block and what they come from, or None when no model was named."""
    from kvtier.workload.trace import TRACE_BLOCK_TOKENS

    tokens = args.block_tokens if args.block_tokens is not None else TRACE_BLOCK_TOKENS
    # --block-tokens also sets the decode stores of --store-chunk mixed: there it needs no model.
    decode_tokens = args.block_tokens is not None and args.store_chunk == "mixed"
    if args.block_bytes is not None:
        if args.model is not None or (args.block_tokens is not None and not decode_tokens):
            given = "--model" if args.model is not None else "--block-tokens"
            raise ConfigError(f"--block-bytes gives a trace block's size itself: drop {given}")
        return args.block_bytes, " (--block-bytes)"
    if settings.sources["model"] == "default":
        if args.block_tokens is not None and not decode_tokens:
            raise ConfigError("--block-tokens sizes a trace block with a model's KV (give --model PRESET too) "
                              "or sets the decode stores of --store-chunk mixed")  # fmt: skip
        return None
    per_token = settings.kv_geometry().bytes_per_token
    source = "" if args.model is not None else f", from {settings.sources['model']}"
    return per_token * tokens, f" ({settings.model}{source}, {tokens} tokens a block)"


def _print_replay(
    args: argparse.Namespace, source: str, summary: dict[str, float], runs: Any, belady: Any, unbounded: Any,
    block: tuple[int, str] | None,
) -> list[dict[str, Any]]:
    """The replay's tables and lines (on stderr with --json - or --plot -); returns the JSON rows."""
    from kvtier.workload.replay import store_mode
    from kvtier.workload.report import ratio_text, replay_rows, replay_table
    from kvtier.workload.textout import text_console

    # With --json - or --plot -, standard output carries that document alone: the tables go to stderr.
    out = text_console(stderr=STDOUT in (args.json, args.plot), min_width=120)
    out.print(
        f"{source}: {summary['requests']} requests, {summary['block_refs']} block references, "
        f"{summary['distinct_blocks']} distinct blocks, {summary['duration_s']:.0f} s"
        + store_mode(args.store_chunk),
        highlight=False, soft_wrap=True, markup=False,  # the trace's file name is printed as it is
    )  # fmt: skip
    if block is not None:
        _say(out, f"block size: {format_size(block[0])} of KV per trace block{block[1]}")
    out.print(f"unbounded cache prefix-hit rate: {100 * unbounded.hit_rate:.1f}%")
    rows = replay_rows(runs, args.policy, belady, unbounded)
    if block is not None:
        for row in rows:
            row["capacity_bytes"] = row["capacity"] * block[0]
    named = f"policy {args.policy[0]}" if len(args.policy) == 1 else f"policies {', '.join(args.policy)}"
    out.print(replay_table(rows, f"prefix-hit rate vs CPU capacity ({named})", None if block is None else block[0]))
    for row in rows:
        bel = row["belady"]
        belady_text = "-" if bel is None else f"{100 * bel['hit_rate']:.2f}%"
        for name in args.policy:
            kv = row["policies"][name]
            out.print(
                f"capacity {row['capacity']}: {name} {100 * kv['hit_rate']:.2f}%  "
                f"belady {belady_text}  unbounded {100 * row['unbounded']['hit_rate']:.2f}%  "
                f"({ratio_text(kv['ratio_to_lru'])}x lru, {kv['self_evictions']} self-evicted)" + _tier_writes(kv),
                highlight=False, soft_wrap=True,
            )  # fmt: skip
    return rows


def _tier_writes(kv: dict[str, Any]) -> str:
    """Each secondary tier's hits, bytes written and admission counts, for a replay's line ("" without)."""
    parts = [
        f"; {label}: {100 * kv['tier_hit_rates'].get(label, 0.0):.2f}% hits, {int(kv[name])} bytes written "
        f"({int(kv.get(f'admitted_blocks:{label}', 0))} blocks admitted, "
        f"{int(kv.get(f'declined_blocks:{label}', 0))} declined)"
        for name in kv if name.startswith("written_bytes:") for label in [name.split(":", 1)[1]]
    ]  # fmt: skip
    return "".join(parts)


def _replay_runs(
    args: argparse.Namespace, trace: Any, keys: Any, capacities: list[int], namespace: Any, err: Any,
    fs_options: dict[str, Any], params: list[Any] | None = None,
) -> dict[int, dict[str, Any]]:
    """Every (capacity, policy) run of the replay of ``trace`` (its requests; ``keys`` their block
    keys; ``fs_options``: the fs tier's, with --fs-root; ``params`` their per-request params, None:
    none), with a progress bar on a terminal (see :class:`~kvtier.workload.progress.RequestProgress`)
    and a line per run on stderr."""
    from kvtier.workload.progress import RequestProgress
    from kvtier.workload.replay import compare_policies, decode_blocks
    from kvtier.workload.trace import TRACE_BLOCK_TOKENS

    requests = len(keys)
    total = requests * len(capacities) * len(dict.fromkeys([*args.policy, "lru"]))
    with DeferredReleases() as releases:
        scratch = _replay_fs_dir(args.fs_root, releases) if args.fs_root is not None else None
        fs_dir = None if scratch is None else str(scratch.path)
        if fs_dir is not None:
            _say(err, f"fs tiers in {fs_dir} (removed after the run)")

        def tiers(policy: str, capacity: int) -> list[dict[str, Any]]:
            if fs_dir is None:
                return []
            return [{"type": "fs", "root": os.path.join(fs_dir, f"{policy.replace(':', '_')}-{capacity}"),
                     **fs_options}]  # fmt: skip

        with RequestProgress(err, total, description="replay", enabled=not args.no_progress) as bar:
            runs_started = [0]

            def announce(policy: str, capacity: int) -> None:
                runs_started[0] += 1
                bar.update((runs_started[0] - 1) * requests, description=f"{policy} @ {capacity} blocks")
                bar.say(f"replaying {requests} requests with {capacity} CPU blocks ({policy})...")

            def progress(done: int) -> None:
                bar.update((runs_started[0] - 1) * requests + done)

            return compare_policies(
                keys, capacities, args.policy, namespace=namespace, tiers=tiers, shm_dir=args.shm_dir,
                store_chunk=args.store_chunk, announce=announce, progress=progress, params=params,
                decode_blocks=decode_blocks(trace, args.block_tokens or TRACE_BLOCK_TOKENS),
            )  # fmt: skip


def _replay(args: argparse.Namespace, outputs: dict[str, OutputFile]) -> int:
    from kvtier.workload.capacity import largest_known_blocks
    from kvtier.workload.chaining import check_chaining
    from kvtier.workload.plot import replay_plot_image
    from kvtier.workload.replay import replay_namespace, trace_keys
    from kvtier.workload.report import json_document
    from kvtier.workload.simulate import HitRateResult, belady_hit_rate, unbounded_hit_rate
    from kvtier.workload.trace import FlatTrace, trace_summary

    settings = load_config(
        cli={"policy": args.policy[0] if args.policy else None, "shm_dir": args.shm_dir, "model": args.model}
    )
    args.policy, args.shm_dir = args.policy or [settings.policy], settings.shm_dir  # env < flags
    _check_shm_dir(settings)
    if args.fs_root is not None:
        _check_fs_root_flag(args.fs_root)
    block = _replay_block_bytes(args, settings)
    if args.capacity:
        _check_replay_capacity([largest_known_blocks(args.capacity) or 1], args.shm_dir)
    requests, source, params = _replay_requests(args)
    if not requests:
        raise ConfigError(f"{source} holds no requests")
    summary = trace_summary(requests)
    capacities = _replay_capacities(args, int(summary["distinct_blocks"]), block)
    _check_replay_capacity(capacities, args.shm_dir)
    fs_options = _replay_fs_options(args, int(summary["distinct_blocks"]))
    flat = FlatTrace.from_requests(requests)
    err = _stderr_console()
    chaining = check_chaining(flat)
    warning = chaining.warning()
    if warning is not None:
        _say(err, f"kvtier replay: warning: {source}: {warning}")
    unbounded = unbounded_hit_rate(flat)
    namespace = replay_namespace(key_seed=args.key_seed)
    if args.key_seed:
        source += f", key seed {args.key_seed}"
    runs = _replay_runs(args, requests, trace_keys(flat, namespace), capacities, namespace, err, fs_options,
                        params)
    belady: dict[int, HitRateResult | None] = {
        c: None if args.no_belady else belady_hit_rate(flat, c) for c in capacities
    }
    rows = _print_replay(args, source, summary, runs, belady, unbounded, block)
    if args.json:
        what = (
            {"synthetic": args.synthetic, "seed": args.seed or 0} if args.synthetic else {"trace": args.trace}
        )
        sizes = {"block_bytes": None if block is None else block[0], "model": settings.model if block else None}
        outputs["--json"].write(json_document({**what, "summary": summary, "chaining": chaining.to_dict(),
                                               "policy": args.policy[0], "policies": args.policy,
                                               "store_chunk": args.store_chunk, "hints": bool(params),
                                               "key_seed": args.key_seed, **sizes, "rows": rows}))  # fmt: skip
        if args.json != STDOUT:
            _say(err, f"wrote {args.json}")
    if args.plot:
        kind = Path(args.plot).suffix.lstrip(".").lower() if args.plot != STDOUT else "png"
        title = f"{source}: prefix-hit rate vs CPU capacity"
        image = replay_plot_image(rows, args.policy, title=title, block_bytes=block[0] if block else None,
                                  block_note=block[1].strip(" ()") if block else "", kind=kind)  # fmt: skip
        outputs["--plot"].write(image)
        if args.plot != STDOUT:
            _say(err, f"wrote {args.plot}")
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
    p.add_argument("--tmp-dir", default=None,
                   help="where bench temp dirs live (default: the system temp dir); a replay's --fs-root DIR for "
                   "its kvtier-replay-* dirs")  # fmt: skip
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
    found = [
        *sweep_stale_temp_dirs(TEMP_DIR_PREFIX, tmp_dir, remove=args.remove),
        *sweep_stale_temp_dirs(REPLAY_DIR_PREFIX, tmp_dir, remove=args.remove),
    ]
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
    p.add_argument("--remove-corrupt", action="store_true",
                   help="delete corrupt values (needs --verify, or --sample for S3)")  # fmt: skip
    p.add_argument("--namespace", default=None, type=_hex_prefix, help="only this namespace digest (hex prefix)")
    p.add_argument("--region", default=None,
                   help="S3 only: the bucket's region (default AWS_REGION or us-east-1)")  # fmt: skip
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


INSPECT_SCHEMES = ("s3://", "http://", "https://")
"""URL forms ``kvtier inspect`` reads (an S3 prefix); anything else is an fs tier directory."""
_URL_TYPO = re.compile(r"(?i)(s3|https?):/?(?!/)")
"""``http:/host/...`` or ``s3:bucket``: an S3 URL missing a '/' of its '://'."""


def _check_inspect_flags(args: argparse.Namespace) -> bool:
    """Refuse what inspect cannot do or would ignore; True when ``args.dir`` is an S3 prefix."""
    from kvtier.tiers.endpoints import redact_url, split_scheme

    target = str(args.dir)
    is_s3 = target.lower().startswith(INSPECT_SCHEMES)
    split = split_scheme(target)  # None for 'http:/KEY://SECRET@host': that '://' is inside the credentials
    if split is not None and not is_s3:
        scheme = split[0]
        raise ConfigError(
            f"inspect reads an fs tier directory or an S3 prefix (s3://bucket/prefix, "
            f"http(s)://host:port/bucket/prefix), not a {scheme}:// URL: a {scheme} tier cannot be inspected offline"
        )
    if not is_s3 and ("@" in target or _URL_TYPO.match(target)) and not os.path.isdir(target):
        # 'http:/key:secret@host/bkt' is no URL and no directory: never echo what precedes the '@'
        shown = "***@" + redact_url(target.rsplit("@", 1)[1]) if "@" in target else redact_url(target)
        raise ConfigError(
            f"inspect target {shown!r} is neither a directory nor an S3 prefix: give s3://bucket/prefix or "
            "http(s)://[key:secret@]host:port/bucket/prefix (with '://' after the scheme), or an fs tier directory"
        )
    if args.sample is not None and not is_s3:
        raise ConfigError("--sample applies to S3 prefixes; for an fs root use --verify")
    if args.sample is not None and args.verify:
        raise ConfigError("--verify reads every block, --sample N only N per namespace: give one of them")
    if args.region is not None and not is_s3:
        raise ConfigError("--region applies to S3 prefixes, not to an fs tier directory: drop it")
    if args.remove_corrupt and not (args.verify or args.sample):
        needs = "--verify or --sample N" if is_s3 else "--verify"
        raise ConfigError(f"--remove-corrupt removes what {needs} finds corrupt: add {needs}")
    return is_s3


def _cmd_inspect(args: argparse.Namespace) -> int:
    from kvtier.tiers.fs import verify_root

    is_s3 = _check_inspect_flags(args)
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
    if report.unsafe_entries:  # e.g. a namespace directory that is a symbolic link: reported, never followed
        print(f"  unsafe entries: {len(report.unsafe_entries)} (not directories of this user: never entered)")
        for c in report.unsafe_entries[:20]:
            print(f"    {c.path}: {c.reason}")
        if len(report.unsafe_entries) > 20:
            print(f"    ... {len(report.unsafe_entries) - 20} more")
    if report.foreign_entries:  # S3: another application's objects beside the namespaces: left alone
        print(f"  foreign entries: {len(report.foreign_entries)} (outside any kvtier namespace: left alone)")
        for path in report.foreign_entries[:5]:
            print(f"    {path}")
        if len(report.foreign_entries) > 5:
            print(f"    ... {len(report.foreign_entries) - 5} more")
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
            for label, entries in (("unreadable:  ", ns.unreadable), ("kept:        ", ns.kept)):
                if entries:  # S3: not proven corrupt, so not counted as corrupt
                    print(f"    {label} {len(entries)} (not proven corrupt: kept)")
                    for c in entries[:20]:
                        print(f"      {c.path}: {c.reason}")
                    if len(entries) > 20:
                        print(f"      ... {len(entries) - 20} more")
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
        + (f", {report.unreadable} unreadable" if report.unreadable else "")
        + (f", {report.kept} kept (not proven corrupt)" if report.kept else "")
    )
    return 0 if report.ok else 1


# --------------------------------------------------------------------------- config


def _field_help(description: str | None) -> str | None:
    """A schema field's description as flag help: its pointers to sections "below" (true in the
    generated reference, which has them) point at that reference instead."""
    if description is None:
        return None
    return re.sub(r"\(see the [^()]* below\)", "(see 'kvtier config reference')", description).replace("%", "%%")


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
                          help=_field_help(info.description))  # fmt: skip
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=_cmd_config_show)
    ref = csub.add_parser("reference", help="print the configuration reference (Markdown)")
    ref.add_argument("--output", metavar="FILE", default=None,
                     help="write to FILE (in place) instead of stdout ('-': stdout)")  # fmt: skip
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
    if args.output:
        check_output_file(args.output, "--output")
    write_output(args.output or STDOUT, render_config_reference(), "--output")
    return 0


def _cmd_config_schema(args: argparse.Namespace) -> int:
    from kvtier.config.json_schema import config_json_schema

    print(json.dumps(config_json_schema(), indent=2))
    return 0


# --------------------------------------------------------------------------- main


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``kvtier bench: error: argument --x: ...`` and where the help
    is, and no abbreviated flags (``--cpu-byte`` is an unknown flag, not ``--cpu-bytes``: a script
    that relied on a prefix would change meaning when a flag sharing it is added)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvtier",
        description="Tiered KV-cache offloading: bench, trace replay, inspection and maintenance.",
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=_VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="{bench,replay,sweep,sweep-shm,inspect,config,fleet}")
    sub.required = True
    _add_bench(sub)
    _add_replay(sub)
    _add_sweep(sub)
    _add_inspect(sub)
    _add_config(sub)
    add_fleet_parser(sub)
    _add_verbose_everywhere(parser)
    return parser


_VERBOSE_HELP = "more logging (-v info, -vv debug)"


def _add_verbose_everywhere(parser: argparse.ArgumentParser, depth: int = 0) -> None:
    """``-v/--verbose`` after any subcommand too (``kvtier replay -v``, ``kvtier config show -v``).

    Each level counts into its own ``verbose_<depth>`` (argparse parses a subcommand
    into a fresh namespace, so one shared counter would keep only the last level's);
    :func:`_verbosity` adds them up.
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                child.add_argument("-v", "--verbose", action="count", default=0, dest=f"verbose_{depth + 1}",
                                   help=_VERBOSE_HELP)  # fmt: skip
                _add_verbose_everywhere(child, depth + 1)


def _innermost_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the subcommand ``args`` ran (``kvtier config show``'s for ``config show``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _innermost_parser(chosen, args)
    return parser


def _unknown_before_the_command(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """Options ``kvtier`` itself does not know, given before any subcommand (``kvtier --bogus``).

    Empty when a subcommand follows: its parser then names what it does not know.
    """
    known = [option for action in parser._actions for option in action.option_strings]
    unknown = []
    for arg in argv:
        if not arg.startswith("-") or arg == "-":
            return []
        name = arg.split("=", 1)[0]
        if name not in known and not re.fullmatch(r"-v+", name):  # (no abbreviations: --vers is unknown)
            unknown.append(arg)
    return unknown


def _verbosity(args: argparse.Namespace) -> int:
    """How many ``-v`` were given, before and after the subcommands."""
    return int(args.verbose) + sum(int(v) for k, v in vars(args).items() if k.startswith("verbose_"))


_POSITIONALS = {"trace": "the trace file", "dir": "the directory or S3 prefix"}


def _empty_value(args: argparse.Namespace) -> str | None:
    """The error for a flag given an empty or blank value (``--fs-root ''``), or None.

    An empty value is never what a user meant: taken as given it would silently
    fall back to a default or mean the current directory.
    """
    for dest, value in vars(args).items():
        if isinstance(value, str) and not value.strip():
            if dest in _POSITIONALS:
                return f"{_POSITIONALS[dest]} is empty: give one"
            flag = cli_flag(dest.removeprefix("field_"))
            return f"argument {flag}: empty value {value!r}: give a value or leave the flag out"
    return None


def _say_error(command: str, text: str) -> None:
    """The one error line of a refused command: no traceback, whitespace folded, and no ``[Errno N]``
    (a message from deeper code that quotes an OSError keeps its words, not Python's errno prefix)."""
    text = re.sub(r"\[Errno -?\d+\]\s*", "", " ".join(text.split()))
    print(f"kvtier {command}: error: {text}", file=sys.stderr)


class _ClosedOutput:
    """Stands in for ``sys.stdout`` when the process started with descriptor 1 closed (``>&-``), where
    Python sets it to ``None`` and ``print`` drops everything silently: every write raises
    ``OSError(EBADF)``, so a command whose output would be lost exits 2 naming the cause instead
    of 0 (or of an ``AttributeError``). Its ``buffer`` is itself (``write_output('-')`` writes bytes)."""

    def write(self, _data: object) -> int:
        raise OSError(errno.EBADF, "standard output is closed")

    def flush(self) -> None:
        """Nothing is buffered."""

    def isatty(self) -> bool:
        return False

    @property
    def buffer(self) -> _ClosedOutput:
        return self


@contextlib.contextmanager
def _standard_streams() -> Iterator[None]:
    """For the command's duration: a closed standard output refuses writes (:class:`_ClosedOutput`);
    a closed standard error swallows the diagnostics (there is nowhere to say them; the exit status
    still tells), so a run does not fail only because nobody listens. A standard output that encodes
    strictly (a UTF-8 locale such as en_US.UTF-8) shows a name that is not UTF-8 (a file
    ``c$'\\xff'.yaml``, decoded by Python with lone surrogates) as ``\\udcff`` instead of failing
    the command on a UnicodeEncodeError."""
    saved = sys.stdout, sys.stderr
    sink = None
    strict = None
    if sys.stdout is None:
        sys.stdout = _ClosedOutput()
    elif isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout.errors == "strict":
        strict = sys.stdout
        strict.reconfigure(errors="backslashreplace")
    if sys.stderr is None:
        sink = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - closed below
        sys.stderr = sink
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        if sink is not None:
            sink.close()
        if strict is not None:
            with contextlib.suppress(OSError, ValueError):  # flushes; the reader may be gone
                strict.reconfigure(errors="strict")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvtier`` console script; returns the exit status. In the main thread,
    Ctrl-C, SIGTERM and SIGHUP end the command cleaning up, with status 130, 143 and 129 (a signal
    the process inherited as ignored stays ignored; see :mod:`kvtier.interrupts`). Started with
    standard output closed, a command that prints exits 2 ("standard output is closed"); with
    standard error closed, its diagnostics are dropped and the exit status is unchanged."""
    with _standard_streams():
        try:
            with raising_interrupts():
                return _main(argv)
        except KeyboardInterrupt as exc:  # before the command ran (parsing its arguments) or after
            return _interrupted(None, exc)


def _interrupted(command: str | None, exc: KeyboardInterrupt) -> int:
    """Say that the command was interrupted (if standard error still has a reader) and return its
    exit status: 128 + the signal's number (130 for Ctrl-C)."""
    signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
    what = f"terminated ({signal.Signals(signum).name})" if isinstance(exc, Terminated) else "interrupted"
    try:
        print(f"kvtier{'' if command is None else ' ' + command}: {what}", file=sys.stderr)
    except (OSError, ValueError):  # a reader killed by the same Ctrl-C (`kvtier ... 2>&1 | less`)
        with contextlib.suppress(OSError, ValueError):
            _to_devnull(sys.stderr)
    return 128 + signum


def _to_devnull(stream: TextIO) -> None:
    """Point ``stream``'s file descriptor at /dev/null: its reader went away, and Python's flush at
    exit must not fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    before = _unknown_before_the_command(parser, sys.argv[1:] if argv is None else list(argv))
    if before:  # argparse would only say that a subcommand is required
        parser.error(f"unrecognized arguments: {' '.join(before)}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the subcommand's own parser, which names its --help
        _innermost_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    empty = _empty_value(args)
    if empty is not None:  # a usage error: said by the subcommand's own parser, which names its --help
        _innermost_parser(parser, args).error(empty)
    verbosity = _verbosity(args)
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args))
    except KvtierError as exc:
        _say_error(args.command, str(exc))
        return 2
    except KeyboardInterrupt as exc:
        return _interrupted(args.command, exc)
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away: stop quietly, without a second error at exit.
        _to_devnull(sys.stdout)
        return 141
    except OSError as exc:
        # The environment refused something no check above named (a permission, a full disk, a port in use).
        where = f"{exc.filename}: " if exc.filename else ""
        _say_error(args.command, f"{where}{os_error_text(exc)}")
        return 2
    except MemoryError:
        _say_error(args.command, "out of memory: lower the sizes and counts given (see --help)")
        return 2
    except Exception as exc:  # a bad input that no check caught: one line, never a traceback (-v logs it)
        logger.info("unexpected error", exc_info=True)
        _say_error(
            args.command,
            f"{type(exc).__name__}: {exception_text(exc)[:300]} (an input no check caught; run with -v for where, "
            "and please report it)",
        )
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
