"""kvtier's log records in a vLLM server's log, in vLLM's format.

vLLM configures its own ``vllm`` logger (its handler, its prefix of process,
level, time and source file) and leaves the root logger alone. kvtier logs under
``kvtier``; with no handler anywhere, Python's last-resort handler printed its
warnings as bare messages (no level, no time) and dropped its INFO lines (the
tiers it started, a Prometheus port, a tier back in service). So a user reading
the server log could not tell when a kvtier warning was written, nor grep it by
level beside vLLM's.

:func:`adopt_vllm_logging` gives the ``kvtier`` logger vLLM's handlers and level,
but only where nobody configured logging: a ``kvtier`` logger with handlers of
its own, or a root logger with handlers (an application's ``logging`` setup,
where kvtier's records already go), is left as it is.
"""

from __future__ import annotations

import logging

KVTIER_LOGGER = "kvtier"
VLLM_LOGGER = "vllm"


def adopt_vllm_logging() -> bool:
    """Route the ``kvtier`` logger to vLLM's handlers, at vLLM's level, if logging is otherwise
    unconfigured (see the module docstring); True if it did. Idempotent; call it after vLLM's
    logger is set up (importing ``vllm`` does that). Caller: the spec's constructor, in each
    engine process (scheduler and workers). Never raises for a logging set-up it does not
    expect: it then leaves logging alone."""
    ours = logging.getLogger(KVTIER_LOGGER)
    theirs = logging.getLogger(VLLM_LOGGER)
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return False
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.propagate = False  # (the root has no handler: nothing is lost)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level)
    return True


__all__ = ["adopt_vllm_logging"]
