"""kvtier for vLLM: ``KvtierOffloadingSpec`` under vLLM's OffloadingConnector.

Importing this package does not import vLLM. The spec lives in
:mod:`kvtier.integrations.vllm.spec` and is loaded by vLLM itself through
``spec_module_path``; :func:`kv_transfer_config` builds the config dict::

    from vllm import LLM
    from kvtier.integrations.vllm import kv_transfer_config

    llm = LLM(model, kv_transfer_config=kv_transfer_config(
        cpu_bytes="8GiB", tiers=[{"type": "fs", "root": "/mnt/nvme/kvtier"}]))
"""

from kvtier.integrations.vllm.config import (
    SPEC_MODULE_PATH,
    SPEC_NAME,
    SUPPORTED_VLLM_RANGE,
    VllmVersionError,
    check_vllm_version,
    kv_transfer_config,
)

__all__ = [
    "SPEC_MODULE_PATH",
    "SPEC_NAME",
    "SUPPORTED_VLLM_RANGE",
    "VllmVersionError",
    "check_vllm_version",
    "kv_transfer_config",
]
