"""A tiny random-weight Llama, built locally, for smoke tests and benchmarks of the vLLM integration.

Nothing is downloaded from a model hub: a byte-level BPE tokenizer is trained on
synthetic text with ``tokenizers`` and a ``LlamaForCausalLM`` with random
weights is saved with ``transformers``. Both packages come with vLLM; they are
imported lazily so this module costs nothing where vLLM is absent.

The sizes default to the smallest shape vLLM's CPU backend accepts (head size
32, 2 layers); ``benchmarks/bench_vllm_ttft.py`` asks for a larger model so
that prefill costs something measurable on a CPU.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlamaShape:
    """Model dimensions. ``head_dim`` must be one vLLM's CPU attention supports (32, 64, 80, ...)."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    vocab_size: int = 512
    max_position_embeddings: int = 4096


_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "chi",
    "psi",
    "omega",
    "cache",
    "tier",
    "block",
    "prefix",
    "offload",
    "shared",
    "memory",
    "disk",
    "engine",
    "token",
    "layer",
    "head",
    "value",
    "key",
    "store",
    "load",
    "promote",
    "evict",
    "region",
    "scheduler",
    "worker",
]


def _corpus(lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 24))) for _ in range(lines)]


def build_tiny_llama(directory: str | Path, shape: TinyLlamaShape | None = None, seed: int = 0) -> Path:
    """Write a random-weight Llama (config, safetensors, tokenizer) into ``directory``.

    Deterministic for a given ``shape`` and ``seed``. Returns the directory. Takes a
    few seconds for the default shape. Blocking; call it from test setup.
    """
    import torch
    from tokenizers import (  # type: ignore[import-not-found,unused-ignore]
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )
    from transformers import (  # type: ignore[import-not-found,unused-ignore]
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    shape = shape or TinyLlamaShape()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.vocab_size - 8,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(2000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out))

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call,unused-ignore]
    # Larger-than-default init spreads the logits, so greedy decoding is not a
    # flat tie and token-identical comparisons are meaningful.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "kvtier_tiny_model.json").write_text(json.dumps({"shape": asdict(shape), "seed": seed}))
    return out


def random_prompt_ids(length: int, seed: int, vocab_size: int = 500, low: int = 8) -> list[int]:
    """A reproducible prompt of token ids in ``[low, vocab_size)`` (past the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(low, vocab_size) for _ in range(length)]
