"""Model presets: known KV layouts by name, so a config can say ``model: qwen2.5-7b``.

Pure data and a lookup; any thread.
"""

from __future__ import annotations

from typing import Any

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_id": "meta-llama/Llama-3.1-8B-Instruct",
        "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
    },
    "llama-3.1-70b": {
        "model_id": "meta-llama/Llama-3.1-70B-Instruct",
        "num_layers": 80, "num_kv_heads": 8, "head_dim": 128,
    },
    "llama-3.2-1b": {
        "model_id": "meta-llama/Llama-3.2-1B-Instruct",
        "num_layers": 16, "num_kv_heads": 8, "head_dim": 64,
    },
    "qwen2.5-7b": {
        "model_id": "Qwen/Qwen2.5-7B-Instruct",
        "num_layers": 28, "num_kv_heads": 4, "head_dim": 128,
    },
    "qwen2.5-0.5b": {
        "model_id": "Qwen/Qwen2.5-0.5B-Instruct",
        "num_layers": 24, "num_kv_heads": 2, "head_dim": 64,
    },
    "mistral-7b": {
        "model_id": "mistralai/Mistral-7B-Instruct-v0.3",
        "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
    },
    "deepseek-v3": {
        "model_id": "deepseek-ai/DeepSeek-V3",
        "num_layers": 61, "num_kv_heads": 1, "head_dim": 576, "kv_factor": 1,
    },
    "opt-125m": {
        "model_id": "facebook/opt-125m",
        "num_layers": 12, "num_kv_heads": 12, "head_dim": 64,
    },
    "tiny": {
        "model_id": "kvtier/tiny",
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 64,
    },
}  # fmt: skip
"""Known model layouts by preset name. Unknown model ids need an explicit ``geometry``."""


def find_preset(model: str) -> dict[str, Any] | None:
    """The preset for a preset name or the model id it stands for (case-insensitive)."""
    lowered = model.lower()
    for name, preset in MODEL_PRESETS.items():
        if lowered in (name, str(preset["model_id"]).lower()):
            return preset
    return None
