"""A separate engine process for the end-to-end tests: ``python vllm_child.py ARGS.json``.

Reads ``{"model", "prompts", "kv_transfer_config", "hold": bool}``, generates
greedily, prints one JSON line ``{"outputs": [[tokens, cached], ...], "stats": ...}`` (stats are
kvtier's counters in in-process mode, null in multi-process mode)
and, with ``hold``, prints ``READY`` and sleeps until killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from vllm_support import engine, generate, offloading_manager, set_engine_env, settle


def main() -> None:
    args = json.loads(Path(sys.argv[1]).read_text())
    set_engine_env()
    with engine(Path(args["model"]), args["kv_transfer_config"]) as llm:
        outputs = generate(llm, args["prompts"])
        stats = None
        if not hasattr(llm.llm_engine.engine_core, "engine_core"):
            pass  # multi-process engine: the connector lives in the EngineCore process
        else:
            settle(llm)
            stats = offloading_manager(llm).kvtier_stats().as_dict()
        print(json.dumps({"outputs": outputs, "stats": stats}), flush=True)
        if args.get("hold"):
            print("READY", flush=True)
            while True:
                time.sleep(1)


if __name__ == "__main__":
    main()
