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

from pdcache.engine.config import ModelConfig, RopeScaling
from pdcache.engine.harmony import HarmonyByteTokenizer
from pdcache.engine.moe import MoEConfig
from pdcache.engine.state_geometry import LinearAttentionConfig
from pdcache.engine.tokenizer import ByteTokenizer

_BYTE_TOKENIZER = ByteTokenizer()
_HARMONY_BYTE_TOKENIZER = HarmonyByteTokenizer()  # same ids, gpt-oss's harmony chat format

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


def _deepseek_moe(num_layers: int, experts: int, top_k: int, width: int,
                  dense_width: int) -> MoEConfig:
    """DeepSeek-V3's routing scaled down: sigmoid scores, 4 groups of which 2 are chosen,
    the correction bias, a shared expert, scaling 2.5, the first layer dense."""
    return MoEConfig(
        family="deepseek_v3", scoring="sigmoid", topk_method="noaux_tc", num_experts=experts,
        top_k=top_k, moe_intermediate_size=width, dense_intermediate_size=dense_width,
        norm_topk_prob=True, num_layers=num_layers,
        sparse_layer_ids=frozenset(range(1, num_layers)), routed_scaling_factor=2.5,
        n_group=4, topk_group=2, n_shared_experts=1)


def _deepseek_yarn(original: int) -> RopeScaling:
    """DeepSeek-V3's YaRN (factor 40 there, 4 here), mscale 1 in cos/sin and softmax."""
    return RopeScaling(factor=4.0, original_max_position_embeddings=original, rope_type="yarn",
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)


_MLA_COMMON = {**_COMMON, "architecture": "DeepseekV3ForCausalLM", "rope_interleave": True}

# MLA + MoE, DeepSeek-V3's shape scaled down (its ratios: latent 512 + 64 rope, nope 128,
# v 128, 256 experts of which 8 routed + 1 shared, 8 groups of which 4 chosen).
PRESETS["tiny-mla"] = ModelConfig(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=48,
    max_position_embeddings=8192,
    rope_theta=10000.0,
    rope_scaling=_deepseek_yarn(2048),
    kv_lora_rank=64,
    q_lora_rank=96,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    moe=_deepseek_moe(4, experts=8, top_k=2, width=96, dense_width=384),
    name="pdcache-tiny-mla",
    **_MLA_COMMON,
)
PRESETS["small-mla"] = ModelConfig(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=96,
    max_position_embeddings=32768,
    rope_theta=10000.0,
    rope_scaling=_deepseek_yarn(8192),
    kv_lora_rank=256,
    q_lora_rank=384,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    moe=_deepseek_moe(8, experts=16, top_k=4, width=256, dense_width=1408),
    name="pdcache-small-mla",
    **_MLA_COMMON,
)



def _gpt_oss_moe(num_layers: int, experts: int, top_k: int, width: int) -> MoEConfig:
    """gpt-oss's MoE: every layer sparse, softmax over the top-k router logits (with bias),
    the clamped SwiGLU (alpha 1.702, limit 7) with biases."""
    return MoEConfig(
        family="gpt_oss", scoring="softmax", topk_method="greedy", num_experts=experts,
        top_k=top_k, moe_intermediate_size=width, dense_intermediate_size=width,
        norm_topk_prob=True, num_layers=num_layers,
        sparse_layer_ids=frozenset(range(num_layers)))


def _gpt_oss_yarn(original: int) -> RopeScaling:
    """gpt-oss's YaRN (factor 32 over 4096 there, 4 here), without truncating the ramp."""
    return RopeScaling(factor=4.0, original_max_position_embeddings=original, rope_type="yarn",
                       beta_fast=32.0, beta_slow=1.0, truncate=False)


def _alternating(num_layers: int) -> tuple[str, ...]:
    """gpt-oss's layer kinds: sliding on even layers, full on odd ones."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention"
                 for i in range(num_layers))


_GPT_OSS_COMMON = {**_COMMON, "architecture": "GptOssForCausalLM", "attention_bias": True,
                   "o_proj_bias": True, "attention_sinks": True, "rms_norm_eps": 1e-5,
                   "rope_theta": 150000.0}

# gpt-oss's shape scaled down (there: 64 query / 8 kv heads of 64, window 128, 32 or 128
# experts of which 4 routed, alternating sliding / full layers with sinks).
PRESETS["tiny-gpt-oss"] = ModelConfig(
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    rope_scaling=_gpt_oss_yarn(2048),
    sliding_window=16,
    layer_types=_alternating(4),
    moe=_gpt_oss_moe(4, experts=8, top_k=2, width=96),
    name="pdcache-tiny-gpt-oss",
    **_GPT_OSS_COMMON,
)
PRESETS["small-gpt-oss"] = ModelConfig(
    hidden_size=512,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    rope_scaling=_gpt_oss_yarn(8192),
    sliding_window=128,
    layer_types=_alternating(8),
    moe=_gpt_oss_moe(8, experts=16, top_k=4, width=256),
    name="pdcache-small-gpt-oss",
    **_GPT_OSS_COMMON,
)



def _qwen3_next_moe(num_layers: int, experts: int, top_k: int, width: int,
                    shared_width: int) -> MoEConfig:
    """Qwen3-Next's MoE: every layer sparse, softmax top-k (normalised), one shared expert
    behind a sigmoid gate."""
    return MoEConfig(
        family="qwen3_next", scoring="softmax", topk_method="greedy", num_experts=experts,
        top_k=top_k, moe_intermediate_size=width, dense_intermediate_size=width,
        norm_topk_prob=True, num_layers=num_layers,
        sparse_layer_ids=frozenset(range(num_layers)),
        shared_expert_intermediate_size=shared_width)


def _every_fourth_full(num_layers: int) -> tuple[str, ...]:
    """Qwen3-Next's layer kinds: gated full attention on every 4th layer, DeltaNet between."""
    return tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                 for i in range(num_layers))


_QWEN3_NEXT_COMMON = {**_COMMON, "architecture": "Qwen3NextForCausalLM", "qk_norm": True,
                      "partial_rotary_factor": 0.25, "rope_theta": 10000.0}

# Qwen3-Next-80B's shape scaled down (there: 48 layers, 16 query / 2 kv heads of 256, DeltaNet
# with 16 key heads / 32 value heads of 128, conv kernel 4, 512 experts of which 10 routed plus
# a shared one, partial RoPE over a quarter of each head).
PRESETS["tiny-qwen3-next"] = ModelConfig(
    hidden_size=128,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    layer_types=_every_fourth_full(4),
    linear_attention=LinearAttentionConfig(conv_kernel=4, key_head_dim=32, value_head_dim=32,
                                           num_key_heads=2, num_value_heads=4),
    moe=_qwen3_next_moe(4, experts=8, top_k=2, width=96, shared_width=96),
    name="pdcache-tiny-qwen3-next",
    **_QWEN3_NEXT_COMMON,
)
PRESETS["small-qwen3-next"] = ModelConfig(
    hidden_size=512,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    layer_types=_every_fourth_full(8),
    linear_attention=LinearAttentionConfig(conv_kernel=4, key_head_dim=64, value_head_dim=64,
                                           num_key_heads=4, num_value_heads=8),
    moe=_qwen3_next_moe(8, experts=16, top_k=4, width=256, shared_width=256),
    name="pdcache-small-qwen3-next",
    **_QWEN3_NEXT_COMMON,
)

# Init scales (multiples of 1/sqrt(fan_in)); see the module docstring for why.
EMBED_STD = 1.0
QK_GAIN = 1.0  # sharper attention amplifies fp32 noise (measured: 2.0 doubles it)
RESIDUAL_GAIN = 1.0  # all 2L residual branches together add about as much as the embedding
LOGIT_STD = 4.0
ROUTING_BIAS_STD = 0.1  # DeepSeek-V3's routing bias, against sigmoid scores in (0, 1)
SINK_STD = 1.0  # gpt-oss's sink logits: a head's sink takes a visible share of its softmax


def preset_config(name: str, dtype: str = "float32") -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return replace(PRESETS[name], dtype=dtype)


def byte_tokenizer() -> ByteTokenizer:
    return _BYTE_TOKENIZER


def preset_tokenizer(name: str) -> ByteTokenizer:
    """The byte tokenizer with preset `name`'s chat format: harmony for the gpt-oss presets
    (pdcache.engine.harmony), ChatML for the others. The ids are the same either way."""
    if preset_config(name).architecture == "GptOssForCausalLM":
        return _HARMONY_BYTE_TOKENIZER
    return _BYTE_TOKENIZER


@torch.no_grad()
def init_preset_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter of `model` (a `CausalLM` or `Qwen3NextForCausalLM`, with its
    `config`) deterministically from `seed` (CPU generator, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    config: ModelConfig = model.config  # type: ignore[assignment]
    residual_gain = RESIDUAL_GAIN / math.sqrt(2 * config.num_hidden_layers)
    # gpt-oss holds its experts' fused weights as [E, in, out], the others as [E, out, in]
    experts_in_dim = -2 if config.moe is not None and config.moe.family == "gpt_oss" else -1
    zero_centred = config.architecture == "Qwen3NextForCausalLM"
    for name, param in model.named_parameters():
        tensor = _qwen3_next_tensor(name, param, gen) if zero_centred else None
        if tensor is None:
            tensor = _init_tensor(name, param, gen, residual_gain, experts_in_dim)
        param.copy_(tensor)


def _qwen3_next_tensor(name: str, param: torch.Tensor,
                       gen: torch.Generator) -> torch.Tensor | None:
    """Qwen3-Next's own parameters (None: as any model's). Its norms scale by `1 + weight`
    (zero here: gain 1), except the DeltaNet output's gated norm (`weight`, one); the decay
    `A_log` and `dt_bias` as transformers initialises them (A uniform in (0, 16))."""
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(param.shape)
    if name.endswith("norm.weight"):
        return torch.zeros(param.shape)
    if name.endswith("A_log"):
        return torch.log(torch.rand(param.shape, generator=gen) * 16 + 1e-3)
    if name.endswith("dt_bias"):
        return torch.ones(param.shape)
    return None


def _init_tensor(
    name: str, param: torch.Tensor, gen: torch.Generator, residual_gain: float,
    experts_in_dim: int = -1,
) -> torch.Tensor:
    shape = param.shape
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.randn(shape, generator=gen) * 0.02
    if name.endswith("e_score_correction_bias"):  # moves the expert choice, as trained ones do
        return torch.randn(shape, generator=gen) * ROUTING_BIAS_STD
    if name.endswith("_proj_bias"):  # gpt-oss's fused expert biases
        return torch.randn(shape, generator=gen) * 0.02
    if name.endswith("self_attn.sinks"):
        return torch.randn(shape, generator=gen) * SINK_STD
    if "embed_tokens" in name:
        return torch.randn(shape, generator=gen) * EMBED_STD
    in_dim = experts_in_dim if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else -1
    fan_in_std = 1.0 / math.sqrt(shape[in_dim])
    gain = 1.0
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        gain = QK_GAIN
    elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
        gain = residual_gain
    elif name == "lm_head.weight":
        gain = LOGIT_STD
    return torch.randn(shape, generator=gen) * fan_in_std * gain
