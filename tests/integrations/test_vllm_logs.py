"""kvtier's log records in vLLM's format (kvtier.integrations.vllm.logs).

Each case runs in a fresh interpreter (logging is process-wide). vLLM's own
set-up is stood in for by a ``vllm`` logger configured as vLLM configures it (a
handler and formatter of its own, ``propagate`` off, the root untouched): the
function under test is real. The real server's log is checked in
``test_vllm_server.py`` (kvtier's start-up lines, with vLLM's prefix).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

VLLM_LIKE = """
import logging, sys
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter("VLLMFMT %(levelname)s [%(name)s] %(message)s"))
vllm = logging.getLogger("vllm")
vllm.addHandler(handler)
vllm.setLevel(logging.INFO)
vllm.propagate = False
"""


def _run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    return (done.stdout + done.stderr).splitlines()


def test_kvtier_records_take_vllms_handlers_and_level() -> None:
    out = _run(VLLM_LIKE + """
from kvtier.integrations.vllm.logs import adopt_vllm_logging
print("adopted", adopt_vllm_logging(), adopt_vllm_logging())
log = logging.getLogger("kvtier.tiers.s3")
log.warning("probe warning")
log.info("probe info")
log.debug("probe debug")
""")
    assert out == [
        "adopted True False",
        "VLLMFMT WARNING [kvtier.tiers.s3] probe warning",
        "VLLMFMT INFO [kvtier.tiers.s3] probe info",
    ], "once, in vLLM's format, at vLLM's level (before: a bare warning line and no INFO)"


def test_an_application_logging_set_up_is_left_alone() -> None:
    out = _run(VLLM_LIKE + """
logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="ROOT %(levelname)s %(message)s")
from kvtier.integrations.vllm.logs import adopt_vllm_logging
print("adopted", adopt_vllm_logging())
logging.getLogger("kvtier.manager").warning("probe warning")
logging.getLogger("kvtier.manager").info("probe info")
""")
    assert out == ["adopted False", "ROOT WARNING probe warning"]


def test_a_kvtier_logger_with_handlers_of_its_own_is_left_alone() -> None:
    out = _run(VLLM_LIKE + """
own = logging.StreamHandler(sys.stdout)
own.setFormatter(logging.Formatter("OWN %(message)s"))
logging.getLogger("kvtier").addHandler(own)
from kvtier.integrations.vllm.logs import adopt_vllm_logging
print("adopted", adopt_vllm_logging())
logging.getLogger("kvtier.x").warning("probe warning")
""")
    assert out == ["adopted False", "OWN probe warning"]


def test_without_a_configured_vllm_logger_nothing_changes() -> None:
    out = _run("""
import logging
from kvtier.integrations.vllm.logs import adopt_vllm_logging
print("adopted", adopt_vllm_logging(), logging.getLogger("kvtier").handlers)
""")
    assert out == ["adopted False []"]
