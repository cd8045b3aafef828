"""Random-weight model presets (fixed seed, nothing downloaded) with the byte tokenizer.

The initialisation is chosen so that greedy decoding is robust and context-dependent:
- logits spread by a few units (std ~4), so top-1 vs top-2 margins sit far above fp32
  summation noise (`pdcache bench engine --margin-steps N` measures both);
- the attention and MLP branches of all layers together carry about as much as the token
  embedding, so continuations depend on the context, not only on the last token;
- no gain above 1 anywhere (sharper attention doubled the chunked-vs-full logit noise), so a
  rounding difference in one layer is not amplified by the next ones.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from pdcache.engine.config import ModelConfig
from pdcache.engine.model import CausalLM
from pdcache.engine.tokenizer import ByteTokenizer

_BYTE_TOKENIZER = ByteTokenizer()

_COMMON = {
    "architecture": "LlamaForCausalLM",
    "vocab_size": _BYTE_TOKENIZER.vocab_size,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": _BYTE_TOKENIZER.bos_token_id,
    "eos_token_ids": _BYTE_TOKENIZER.eos_token_ids,
}

PRESETS: dict[str, ModelConfig] = {
    # ~1M parameters: fast enough for every test.
    "tiny": ModelConfig(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        name="pdcache-tiny",
        **_COMMON,
    ),
    # ~23M parameters: prefill compute dominates on a small CPU, long contexts allowed.
    "small": ModelConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        rope_theta=500000.0,
        name="pdcache-small",
        **_COMMON,
    ),
}

# Init scales (multiples of 1/sqrt(fan_in)); see the module docstring for why.
EMBED_STD = 1.0
QK_GAIN = 1.0  # sharper attention amplifies fp32 noise (measured: 2.0 doubles it)
RESIDUAL_GAIN = 1.0  # all 2L residual branches together add about as much as the embedding
LOGIT_STD = 4.0


def preset_config(name: str, dtype: str = "float32") -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], dtype=dtype)


def byte_tokenizer() -> ByteTokenizer:
    return _BYTE_TOKENIZER


@torch.no_grad()
def init_preset_weights(model: CausalLM, seed: int) -> None:
    """Fill every parameter of `model` deterministically from `seed` (CPU generator, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    residual_gain = RESIDUAL_GAIN / math.sqrt(2 * config.num_hidden_layers)
    for name, param in model.named_parameters():
        param.copy_(_init_tensor(name, param, gen, residual_gain))


def _init_tensor(
    name: str, param: torch.Tensor, gen: torch.Generator, residual_gain: float
) -> torch.Tensor:
    shape = param.shape
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.randn(shape, generator=gen) * 0.02
    if "embed_tokens" in name:
        return torch.randn(shape, generator=gen) * EMBED_STD
    fan_in_std = 1.0 / math.sqrt(shape[1])
    gain = 1.0
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        gain = QK_GAIN
    elif name.endswith(("o_proj.weight", "down_proj.weight")):
        gain = residual_gain
    elif name == "lm_head.weight":
        gain = LOGIT_STD
    return torch.randn(shape, generator=gen) * fan_in_std * gain
