"""``KvtierOffloadingSpec``: kvtier as a vLLM OffloadingSpec.

Select it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
        "spec_module_path": "kvtier.integrations.vllm.spec", "cpu_bytes": "8GiB",
        "tiers": [{"type": "fs", "root": "/mnt/nvme/kvtier"}]}}'

vLLM builds the spec in its scheduler process and in every worker process.
The scheduler side (:meth:`get_manager`) creates the :class:`TieringManager`,
its shared CPU region in /dev/shm and the secondary tiers; each worker
(:meth:`get_worker`) attaches to the same region (name derived from vLLM's
``engine_id``) and copies KV blocks into and out of it. The region's path is
unlinked once the scheduler and every worker have mapped it, so nothing is left
in /dev/shm after the engine exits, even after SIGKILL.

vLLM also evaluates :meth:`KvtierOffloadingSpec.build_metric_definitions` in
its API server process: the metrics kvtier reports through the connector stats
(:mod:`kvtier.integrations.vllm.stats`) then appear in the server's ``/metrics``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvtier.config import build_manager
from kvtier.engine_events import EngineEventStream
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import (
    EngineLayout,
    allow_untested_vllm,
    check_vllm_version,
    installed_vllm_version,
    resolve_settings,
)
from kvtier.integrations.vllm.logs import adopt_vllm_logging

logger = logging.getLogger(__name__)


def engine_layout(config: OffloadingConfig) -> EngineLayout:
    """The parts of vLLM's OffloadingConfig that decide the region layout and namespace."""
    tokens_per_block = max((g.tokens_per_block for g in config.groups), default=0)
    return EngineLayout(
        engine_id=str(config.engine_id),
        model_name=str(config.model.name),
        kv_dtype=str(config.model.dtype),
        tokens_per_chunk=tokens_per_block * config.cache.blocks_per_chunk,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
        world_size=config.parallel.world_size,
        tp_size=config.parallel.tp_size,
        pp_size=config.parallel.pp_size,
        layer_names=tuple(name for g in config.groups for name in g.layer_names),
        kv_cache_layout=str(config.kv_cache_layout or ""),
    )


class KvtierOffloadingSpec(OffloadingSpec):  # type: ignore[misc,unused-ignore]
    """vLLM OffloadingSpec backed by kvtier; see the module docstring.

    Construction validates the vLLM version and the configuration (raising
    :class:`ConfigError` with the bad key and the fix) but creates nothing; the
    manager and the worker are built on first request and cached.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """kvtier's metrics in vLLM's Prometheus registry (called by vLLM in its API server process)."""
        from kvtier.integrations.vllm.stats import metric_definitions

        return {**super().build_metric_definitions(extra_config), **metric_definitions(extra_config)}

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        adopt_vllm_logging()  # kvtier's records in vLLM's format (unless logging is configured)
        extra: dict[str, Any] = dict(self.extra_config)
        version = installed_vllm_version()
        allow = allow_untested_vllm(extra)
        check_vllm_version(version, allow_untested=allow)
        if allow:
            logger.warning("kvtier: running on vllm %s with allow_untested_vllm=true", version)
        if config.canonical_layout:
            raise ConfigError(
                "kv_connector_extra_config['canonical_layout'] is not supported by kvtier: remove it "
                "(kvtier stores each rank's blocks in the engine's own layout)"
            )
        self.layout = engine_layout(config)
        self.settings = resolve_settings(extra, self.layout)
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        """Scheduler side: build (once) the TieringManager, its region and tiers. Blocks while
        the region is created and pre-faulted."""
        if self._manager is None:
            from kvtier.integrations.vllm.manager import KvtierOffloadingManager
            from kvtier.primary import RESET_HOLD_STEPS

            s = self.settings
            tiering = build_manager(
                s.config,
                expected_mappers=s.expected_mappers,
                namespace=s.namespace,
                block_bytes=s.layout.row_bytes,
                region_name=s.region_name,
                num_cpu_blocks=s.num_rows,
                # vLLM drains take_events() only when it publishes KV cache events.
                events=bool(self.kv_events_config.enable_kv_cache_events),
            )
            metrics = None
            if s.metrics_port is not None:
                from kvtier.metrics import KvtierMetrics

                metrics = KvtierMetrics()
                try:
                    port = metrics.serve(s.metrics_port)
                except BaseException:
                    tiering.shutdown()
                    raise
                logger.info("kvtier: Prometheus metrics on http://127.0.0.1:%d/metrics", port)
            events = None
            if self.kv_events_config.enable_kv_cache_events:
                events = EngineEventStream(tiering, engine=s.layout.engine_id, info=self._event_info())
            hold = RESET_HOLD_STEPS + max(0, self.config.parallel.pp_size - 1)
            self._manager = KvtierOffloadingManager(tiering, metrics=metrics, events=events, reset_hold_steps=hold)
            logger.info(
                "kvtier: CPU tier of %d rows x %d bytes in region %s, %d secondary tier(s), "
                "namespace %s",
                s.num_rows, s.layout.row_bytes, s.region_name, len(tiering.tiers),
                s.namespace.hexdigest,
            )
        return self._manager

    def _event_info(self) -> dict[str, Any]:
        """What a consumer of this engine's KV events needs to compute its block keys from tokens."""
        info: dict[str, Any] = {
            "engine": "vllm",
            "model": self.layout.model_name,
            "namespace": self.settings.namespace.hexdigest,
            "tokens_per_hash": int(self.config.cache.tokens_per_hash),
            "blocks_per_chunk": int(self.config.cache.blocks_per_chunk),
            "hash_seed_from_env": "PYTHONHASHSEED" in os.environ,
        }
        try:  # the engine's config, when vLLM built this spec inside it
            from vllm.config import get_current_vllm_config

            vllm_config = get_current_vllm_config()
            if str(vllm_config.model_config.model) == self.layout.model_name:
                info["hash"] = str(vllm_config.cache_config.prefix_caching_hash_algo)
        except Exception:
            logger.debug("kvtier: vLLM's prefix caching hash algorithm is not known here", exc_info=True)
        return info

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """Worker side: attach (once) to the region and return the copy worker."""
        if self._worker is None:
            from kvtier.integrations.vllm.worker import KvtierOffloadingWorker

            self._worker = KvtierOffloadingWorker(
                kv_caches, self.settings, rank=self.config.parallel.rank
            )
        return self._worker
