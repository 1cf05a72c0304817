"""What the manager logs of its tiers' failed jobs, and of reports of jobs it does not know.

A load that failed means the engine recomputes those blocks, a store that failed means they are
not in that tier; the counters (``promotion_job_failed``, ``cascade_job_failed``) say how often,
this log says why. A failure is logged at WARNING at the 1st, 10th, 100th... failed job of its
kind on a tier (:func:`decade`), naming the tier by index, type and class, the job, how many of
its blocks failed and the tier's own words: a tier failing every job never fills the log, and
the first failure of a run is always there to read. Scheduler thread; nothing here blocks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvtier.manager.handle import TierHandle
    from kvtier.tiers.base import JobResult

logger = logging.getLogger(__name__)


def decade(n: int) -> bool:
    """True for the 1st, 10th, 100th... occurrence of a repeated event: the ones logged."""
    return n > 0 and str(n).rstrip("0") == "1"


def log_failed_job(handle: TierHandle, what: Literal["load", "store"], result: JobResult, failed: int, blocks: int,
                   failed_jobs: int) -> None:  # fmt: skip
    """``result`` reports ``failed`` of the ``blocks`` of a ``what`` job of ``handle``'s tier
    failed, the tier's ``failed_jobs``-th failed job of that kind: warned at each :func:`decade`."""
    if failed <= 0 or not decade(failed_jobs):  # (a job reported failed with every block done: nothing to say)
        return
    tier = handle.tier
    consequence = "the engine recomputes them" if what == "load" else "not stored there"
    # The tier's words on one line, cut as the snapshot's last_error is (any tier's text: a server's reply)
    reason = " ".join(str(result.error or "no reason given").split())[:300]
    logger.warning(
        "secondary tier #%d (type=%s, class=%s): %s job %d: %d of %d blocks failed (%s): %s "
        "[%d failed %s jobs on this tier so far; logged at the 1st, 10th, 100th...]",
        handle.index, tier.tier_type, type(tier).__qualname__, what, result.job_id, failed, blocks, consequence,
        reason, failed_jobs, what,
    )  # fmt: skip


def log_unknown_job(handle: TierHandle, job_id: int, n: int) -> None:
    """``handle``'s tier reported job ``job_id``, which the manager does not know (its ``n``-th such
    report, counted ``unknown_job_results``): logged at ERROR at each :func:`decade`."""
    if decade(n):
        logger.error("secondary tier #%d (type=%s, class=%s) reported unknown job %d; ignored (%d so far)",
                     handle.index, handle.tier.tier_type, type(handle.tier).__qualname__, job_id, n)  # fmt: skip


__all__ = ["decade", "log_failed_job", "log_unknown_job"]
