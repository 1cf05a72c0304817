"""The steps of ``TieringManager.create``: sizes and options checked, the region, the tiers.

Everything that can be checked without side effects is checked first
(:func:`sizes`, :func:`check_settings`, :func:`check_policy_and_tiers`);
then :func:`new_region` and :func:`assemble`, which, if a step fails, shuts down
the tiers already built in reverse order, releases the region and raises the
original error (DESIGN.md section 5). Creating the region blocks while it is
pre-faulted (about 0.9 s per GiB); each tier's constructor may block while it starts.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvtier.errors import ConfigError, RegionBusyError, RegionError, clear_exception_frames, int_text
from kvtier.failures import log_failure
from kvtier.keys import Namespace
from kvtier.manager.blocking import BlockingCalls
from kvtier.manager.waits import FAILED_LOAD_SECONDS_RANGE, WAIT_TIMEOUT_RANGE
from kvtier.policies import resolve_policy
from kvtier.primary import PrimaryTier
from kvtier.region import SharedRegion, check_shm_dir, region_path
from kvtier.tiers.base import SecondaryTier, TierContext
from kvtier.tiers.registry import create_tier, validate_tier_options
from kvtier.types import RequestContext
from kvtier.units import MAX_SIZE, format_size, parse_size, row_stride_for, rows_that_fit
from kvtier.validation import check_seconds, shown_value

logger = logging.getLogger(__name__)

_M = TypeVar("_M")

DEFAULT_SHUTDOWN_TIMEOUT = 120.0
"""Seconds ``TieringManager.shutdown`` gives all secondary tiers together."""

MAX_CPU_BLOCKS = 1 << 32
"""The most CPU-tier rows a manager takes (``num_cpu_blocks``), in every source of the configuration."""


def check_shutdown_timeout(timeout: float | None, name: str = "shutdown_timeout", *, positive: bool = False,
                           none_means: str = "no deadline") -> None:  # fmt: skip
    """A deadline of the Python API: finite seconds in [0, MAX_SECONDS] ((0, ...] when ``positive``)
    or None, which stands for ``none_means`` (ConfigError naming ``name``)."""
    check_seconds(timeout, name, allow_none=True, positive=positive, none_means=none_means)


def bad_call(call: str, keys: Any, request: Any, success: Any, needed: bool = False) -> TypeError | None:
    """What is wrong with the arguments of the manager's ``call`` (the keys as a whole, the
    request, which may be None unless ``needed``, ``success``; each key is checked apart), or None."""
    if keys is None or isinstance(keys, bytes | bytearray | memoryview | str) or not _iterable(keys):
        return TypeError(f"{call}: keys must be a list (or another iterable) of block keys, got "
                         f"{type(keys).__name__}: pass [key] for one key")  # fmt: skip
    if (request is not None or needed) and not isinstance(request, RequestContext):
        return TypeError(f"{call}: request must be a RequestContext{'' if needed else ' (or None)'}, got "
                         f"{type(request).__name__}")  # fmt: skip
    if success is not True and success is not False:
        return TypeError(f"{call}: success must be True or False, got {type(success).__name__} {success!r:.40}")
    return None


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def listed(call: str, keys: Any, request: Any) -> list[Any]:
    """``keys`` (not a list or tuple) as a list; raises what :func:`bad_call` finds first."""
    if wrong := bad_call(call, keys, request, True):
        raise wrong
    return list(keys)


def check_settings(shutdown_timeout: float | None, drain_timeout: float | None, lookup_timing_every: int,
                   wait_timeout: float, failed_load_seconds: float) -> float:
    """Check the manager's settings (ConfigError naming the one that is wrong); returns
    ``failed_load_seconds`` as a float."""
    if type(shutdown_timeout) in (int, float) and shutdown_timeout == 0:
        raise ConfigError("shutdown_timeout must be above 0 seconds (None: no deadline), got 0: it would abandon "
                          "every secondary tier at every shutdown")  # fmt: skip
    check_shutdown_timeout(shutdown_timeout, positive=True)  # inf, nan, -1: "above 0", as for 0
    check_shutdown_timeout(drain_timeout, "drain_timeout")
    if isinstance(lookup_timing_every, bool) or not isinstance(lookup_timing_every, int) or lookup_timing_every < 1:
        raise ConfigError(f"lookup_timing_every must be an integer >= 1, got {lookup_timing_every!r}")
    check_seconds(wait_timeout, "wait_timeout", bounds=WAIT_TIMEOUT_RANGE)
    check_seconds(failed_load_seconds, "failed_load_seconds", bounds=FAILED_LOAD_SECONDS_RANGE)
    return float(failed_load_seconds)


def new_region(name: str | None, num_cpu_blocks: int, block_bytes: int, shm_dir: str | os.PathLike[str], *,
               expected_mappers: int, prefault: bool, pin: bool, sweep_stale: bool) -> SharedRegion:
    """The shared region of the CPU tier (stale regions of dead engines swept first, if asked)."""
    check_shm_dir(shm_dir)
    if sweep_stale:
        SharedRegion.sweep_stale(shm_dir, remove=True)
    return SharedRegion(name or f"{os.getpid()}-{uuid.uuid4().hex[:12]}", num_cpu_blocks, block_bytes,
                        expected_mappers=expected_mappers, shm_dir=shm_dir, prefault=prefault, pin=pin,
                        scheduler=True)


def assemble(region: SharedRegion, block_bytes: int, policy: str, specs: Sequence[dict[str, Any]],
             namespace: Namespace, events: bool, make: Callable[[PrimaryTier, list[SecondaryTier]], _M],
             shutdown_timeout: float | None = DEFAULT_SHUTDOWN_TIMEOUT) -> _M:
    """``make(primary, tiers)`` with the CPU tier over ``region`` and each tier of ``specs`` built
    in order. If a step fails, the tiers built are shut down in reverse order (within
    ``shutdown_timeout`` seconds together, None: no deadline; one that overruns is abandoned),
    the region is released, and the original error is raised."""
    built: list[SecondaryTier] = []
    primary: PrimaryTier | None = None
    try:
        primary = PrimaryTier(region, block_bytes, policy, record_events=events)
        _build_tiers(specs, region, block_bytes, namespace, built)
        return make(primary, built)
    except BaseException as exc:
        # The failed constructors' frames (kept alive by the exception's traceback, which the
        # caller may keep) still reference the CPU rows: drop their locals, or the mapping (and
        # its memory) would outlive this call.
        clear_exception_frames(exc)
        _cleanup_failed_construction(region, primary, built, shutdown_timeout)
        raise


def sizes(namespace: Namespace, block_bytes: int | None, num_cpu_blocks: int | None,
          cpu_bytes: int | str | None) -> tuple[int, int]:
    """``(block_bytes, num_cpu_blocks)`` from what was given; ConfigError if they cannot be had."""
    if block_bytes is None:
        if namespace.geometry is None:
            raise ConfigError("give block_bytes: the namespace has no KV geometry to derive it from")
        block_bytes = namespace.geometry.bytes_per_block
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes < 1:
        raise ConfigError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    return block_bytes, _cpu_rows(num_cpu_blocks, cpu_bytes, block_bytes)


def _cpu_rows(num_cpu_blocks: int | None, cpu_bytes: int | str | None, block_bytes: int) -> int:
    """The CPU tier's rows from ``create``'s arguments, or a ConfigError naming the bad one (both
    given is one: they are one setting, as in every other source of the configuration)."""
    if num_cpu_blocks is not None and cpu_bytes is not None:
        raise ConfigError(f"cpu_bytes ({shown_value(cpu_bytes)}) and num_cpu_blocks ({shown_value(num_cpu_blocks)}) "
                          "are both given: they size the same CPU tier, give only one of them")  # fmt: skip
    if num_cpu_blocks is None:
        if cpu_bytes is None:
            raise ConfigError("give the CPU tier a size: num_cpu_blocks or cpu_bytes")
        try:
            size = parse_size(cpu_bytes)
        except ConfigError as exc:
            raise ConfigError(f"cpu_bytes: {exc}") from None
        return rows_that_fit(size, block_bytes)
    if isinstance(num_cpu_blocks, bool) or not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 1:
        raise ConfigError(f"num_cpu_blocks must be a positive integer, got {shown_value(num_cpu_blocks)}")
    stride = row_stride_for(block_bytes)
    if num_cpu_blocks > MAX_SIZE // stride:  # (first: past 8 EiB, what the rows would take is the news)
        raise ConfigError(f"num_cpu_blocks={int_text(num_cpu_blocks)} rows of {format_size(stride)} are above the "
                          "largest size kvtier accepts (8 EiB): give fewer blocks")  # fmt: skip
    if num_cpu_blocks > MAX_CPU_BLOCKS:
        raise ConfigError(f"num_cpu_blocks={int_text(num_cpu_blocks)} is above the most kvtier accepts, "
                          f"{MAX_CPU_BLOCKS} (2^32): give fewer blocks")  # fmt: skip
    return num_cpu_blocks


def check_arguments(namespace: object, policy: object, tiers: object, region_name: object, expected_mappers: object,
                    backpressure: object, flags: dict[str, object]) -> None:
    """The types of ``create()``'s arguments (ConfigError naming the one that is wrong): a
    wrong type would otherwise fail deep inside, or be taken for something else (``events="no"``
    is truthy)."""
    from kvtier.backpressure import BackpressureSettings
    from kvtier.policies.base import EvictionPolicy

    if not isinstance(namespace, Namespace):
        raise ConfigError(f"namespace must be a kvtier.Namespace, got {type(namespace).__name__}")
    if not isinstance(policy, (str, EvictionPolicy)):
        raise ConfigError(f"policy must be a policy name (e.g. 'lru') or an EvictionPolicy, got {policy!r:.80}")
    if not isinstance(tiers, (list, tuple)) or not all(isinstance(spec, dict) for spec in tiers):
        raise ConfigError(f"tiers must be a list of tier specs ({{'type': ..., **options}}), got {tiers!r:.80}")
    if region_name is not None:
        try:
            region_path(region_name)  # type: ignore[arg-type]
        except RegionError as exc:
            raise ConfigError(f"region_name: {exc}") from None
    if isinstance(expected_mappers, bool) or not isinstance(expected_mappers, int) or expected_mappers < 1:
        raise ConfigError(f"expected_mappers must be an integer >= 1, got {expected_mappers!r:.80}")
    if backpressure is not None and not isinstance(backpressure, BackpressureSettings):
        raise ConfigError(f"backpressure must be a BackpressureSettings or None, got {backpressure!r:.80}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r:.80}")


def check_policy_and_tiers(policy: str, tiers: Sequence[dict[str, Any]]) -> None:
    if isinstance(policy, str):
        resolve_policy(policy)
    for index, spec in enumerate(tiers, start=1):
        validate_tier_options(spec, where=f"secondary tier #{index}")


def _build_tiers(specs: Sequence[dict[str, Any]], region: SharedRegion, block_bytes: int, namespace: Namespace,
                 built: list[SecondaryTier]) -> None:
    """Append each tier of ``specs``, in order, to ``built`` (so the caller can clean up after a failure)."""
    for index, spec in enumerate(specs, start=1):
        context = TierContext(rows=region.rows, block_bytes=block_bytes, namespace=namespace, index=index)
        built.append(create_tier(spec, context))
        del context  # this frame may outlive the call in a traceback: it keeps no view of the rows


def _cleanup_failed_construction(region: SharedRegion, primary: PrimaryTier | None,
                                 built: list[SecondaryTier], timeout: float | None) -> None:
    """Shut down every tier of ``built`` in reverse order (sharing ``timeout``), then release the region.

    Nothing can retry this cleanup (the caller gets no manager), so a KeyboardInterrupt or
    SystemExit inside one tier's ``shutdown()`` does not stop it: the remaining tiers are still
    shut down (within their shares of the deadline), then the region's path is unlinked but its
    mapping and descriptor are kept (the interrupted tier may still use the rows: an interrupt
    never leads to releasing the CPU tier), and the first interrupt is raised.
    """
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    interrupt: BaseException | None = None
    # Each tier's context, read before any shutdown: a tier may drop its own there (its duty is to
    # drop every view of the rows), and the context's view is still released here.
    contexts = [getattr(tier, "context", None) for tier in built]
    for done, tier in enumerate(reversed(built)):
        index = len(built) - done  # tiers are built in order from #1
        context = contexts[index - 1]
        share = None if deadline is None else max(0.0, deadline - time.monotonic()) / (len(built) - done)
        what = (f"cleanup after failed construction: secondary tier #{index} "
                f"(type={tier.tier_type}, class={type(tier).__qualname__})")
        try:
            finished, exc = BlockingCalls(tier, f"cleanup-{index}").run("shutdown", share)
        except (KeyboardInterrupt, SystemExit) as stop:
            logger.error("%s was interrupted (%s); the CPU region stays mapped", what, type(stop).__name__)
            interrupt = interrupt or stop
            continue
        if not finished:  # still running: it may use the rows, which stay mapped (see below)
            logger.error("%s did not shut down within its %.3gs share of shutdown_timeout; abandoned", what,
                         share or 0.0)  # fmt: skip
            continue
        if exc is None:
            if isinstance(context, TierContext):
                context.release_rows()
        else:
            # Its traceback is kept: the error being raised (``exc.__context__``) still needs its own.
            log_failure(logger, logging.ERROR, what + " failed to shut down", exc, with_traceback=True,
                        keep_traceback=True)  # fmt: skip
    built.clear()
    contexts.clear()  # what the tiers held, no longer kept here (a failed one's view goes with its tier)
    context = None
    if interrupt is not None:
        region.unlink_if_ours()  # (a restart under this name is never refused for it)
        raise interrupt
    if primary is not None:
        primary.rows = None
    try:
        region.close()
    except RegionBusyError:
        # Something outside kvtier still holds a view of the rows: make sure the path cannot
        # leak, and let the mapping go with the last reference.
        logger.warning(
            "region %s still referenced after failed construction; its path is unlinked, its memory is "
            "returned when the last view of its rows is dropped", region.name,
        )
        region.unlink_if_ours()


__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT", "assemble", "bad_call", "check_arguments", "check_policy_and_tiers", "check_settings",
    "check_shutdown_timeout", "listed", "new_region", "sizes",
]
