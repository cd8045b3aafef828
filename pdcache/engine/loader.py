"""Building a ready model + tokenizer from a preset name or a local Hugging Face checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from pdcache.engine.config import (
    DTYPES,
    MLA_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeScaling,
)
from pdcache.engine.kv_pool import allocate_kv_tensor
from pdcache.engine.model import CausalLM
from pdcache.engine.moe import convert_checkpoint_tensors, moe_config_from_hf
from pdcache.engine.presets import PRESETS, init_preset_weights, preset_config, preset_tokenizer
from pdcache.engine.qwen3_next import ARCHITECTURE as QWEN3_NEXT
from pdcache.engine.qwen3_next import Qwen3NextForCausalLM, qwen3_next_config_from_hf
from pdcache.engine.tokenizer import HFTokenizer, Tokenizer
from pdcache.engine.weights import iter_safetensors, load_weights, safetensors_files

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "qwen3_next": QWEN3_NEXT,
}
# Architectures we know and do not run, with the feature that stops us.
_REFUSED_ARCHITECTURES = {
    "DeepseekV32ForCausalLM": "DeepSeek sparse attention (the DSA indexer of DeepSeek-V3.2)",
}
_ROPE_TYPES = ("default", "llama3", "yarn")
# HF `layer_types` entries the decoder runs (others, e.g. "linear_attention" outside
# Qwen3-Next, are refused; Qwen3-Next checks its own in `qwen3_next_config_from_hf`).
_LAYER_TYPES = ("full_attention", "sliding_attention")
DecoderModel = CausalLM | Qwen3NextForCausalLM
_GPT_OSS = "GptOssForCausalLM"


def load_model(
    spec: str, *, dtype: str | None = None, seed: int = 0, device: str = "cpu"
) -> tuple[DecoderModel, Tokenizer]:
    """`spec` is a preset name (`tiny`, `small`, `tiny-mla`, `tiny-gpt-oss`, ...: `PRESETS`,
    random weights from `seed`) or the path of a local checkpoint directory (config.json, *.safetensors, tokenizer.json). `dtype` defaults
    to float32 for presets and to the checkpoint's dtype otherwise. The model is in eval mode
    with gradients off."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if spec in PRESETS:
        model, tokenizer = _load_preset(spec, dtype or "float32", seed)
    else:
        model, tokenizer = _load_checkpoint(_checkpoint_dir(spec), dtype)
    model = model.to(device=device, dtype=model.config.torch_dtype).eval()
    model.requires_grad_(False)
    return model, tokenizer


def load_model_config(spec: str, *, dtype: str | None = None, seed: int = 0) -> ModelConfig:
    """The ModelConfig `load_model(spec, dtype=dtype, seed=seed)` would build, without weights
    (cheap: for routers and benchmarks that only need shapes, limits and the model name)."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if spec in PRESETS:
        return _preset_config(spec, dtype or "float32", seed)
    return _checkpoint_config(_checkpoint_dir(spec), dtype)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `load_model(spec)` would return, without loading weights."""
    if spec in PRESETS:
        return preset_tokenizer(spec)
    path = _checkpoint_dir(spec)
    return HFTokenizer(path, eos_token_ids=_checkpoint_config(path, None).eos_token_ids)


def allocate_device_kv(
    config: ModelConfig, num_pages: int, page_size: int, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """A zeroed device KV pool of the model's KV geometry, in its dtype."""
    return allocate_kv_tensor(config, num_pages, page_size, device)


def _checkpoint_dir(spec: str) -> Path:
    if not Path(spec).is_dir():
        raise ValueError(
            f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory"
        )
    return Path(spec)


def _preset_config(name: str, dtype: str, seed: int) -> ModelConfig:
    config = preset_config(name, dtype)
    if seed != 0:  # other weights: the name (part of the KV fingerprint) must differ too
        config = replace(config, name=f"{config.name}-seed{seed}")
    return config


def model_class(config: ModelConfig) -> type[CausalLM] | type[Qwen3NextForCausalLM]:
    """The module that runs `config`'s architecture (Qwen3-Next has its own decoder)."""
    return Qwen3NextForCausalLM if config.architecture == QWEN3_NEXT else CausalLM


def _load_preset(name: str, dtype: str, seed: int) -> tuple[DecoderModel, Tokenizer]:
    config = _preset_config(name, dtype, seed)
    model = model_class(config)(config)
    init_preset_weights(model, seed)
    return model, preset_tokenizer(name)


def _checkpoint_config(path: Path, dtype: str | None) -> ModelConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    return model_config_from_hf(json.loads(config_file.read_text()), path.name, dtype)


def _load_checkpoint(path: Path, dtype: str | None) -> tuple[DecoderModel, Tokenizer]:
    config = _checkpoint_config(path, dtype)
    tokenizer = HFTokenizer(path, eos_token_ids=config.eos_token_ids)
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to_empty(device="cpu").to(config.torch_dtype)
    if config.tie_word_embeddings:  # to_empty re-creates parameters: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    tensors = _decoder_tensors(iter_safetensors(safetensors_files(path)), config)
    load_weights(model, tensors)
    return model, tokenizer


def _decoder_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under our names: the multi-token-prediction layers right after
    the decoder's (`num_nextn_predict_layers`, DeepSeek-V3's layer 61: we do not decode
    speculatively) left out, per-expert tensors fused (`convert_checkpoint_tensors`). Any
    other layer past the decoder stays, and fails the load as an unexpected tensor."""
    mtp = range(config.num_hidden_layers,
                config.num_hidden_layers + config.num_nextn_predict_layers)
    kept = (item for item in tensors if _layer_index(item[0]) not in mtp)
    return convert_checkpoint_tensors(kept, config.moe) if config.moe is not None else kept


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None


def model_config_from_hf(
    hf: dict[str, Any], name: str = "model", dtype: str | None = None
) -> ModelConfig:
    """Translate a Hugging Face config.json dict; ValueError for what this engine can't run."""
    arch = _architecture(hf)
    if arch == QWEN3_NEXT:  # its layer kinds, partial RoPE and DeltaNet keys
        _check_quantization(hf)
        return qwen3_next_config_from_hf(hf, name, dtype)
    _check_supported_features(hf, arch)
    heads = hf["num_attention_heads"]
    config = ModelConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(_rope_params(hf).get("rope_theta",
                                              150000.0 if arch == _GPT_OSS else 10000.0)),
        rope_scaling=_rope_scaling(hf),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=_sliding_window(hf, arch),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_tuple(hf.get("eos_token_id")),
        dtype=dtype or _checkpoint_dtype(hf),
        name=name,
        moe=moe_config_from_hf(hf, arch),
    )
    if arch == _GPT_OSS:
        return replace(config, **_gpt_oss_fields(hf))
    return replace(config, **_mla_fields(hf)) if arch in MLA_ARCHITECTURES else config


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's attention: per-layer kinds (transformers' default when config.json has none:
    sliding on even layers, full on odd ones), sinks on every layer, `attention_bias` on
    q/k/v and o_proj."""
    layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {"layer_types": tuple(layer_types), "attention_sinks": True,
            "o_proj_bias": bool(hf.get("attention_bias", True))}


def _mla_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3's latent attention: ranks, head dims, RoPE layout (V2 always rotates
    interleaved pairs; V3 says so in `rope_interleave`, default true)."""
    return {
        "kv_lora_rank": int(hf["kv_lora_rank"]),
        "q_lora_rank": hf.get("q_lora_rank"),
        "qk_nope_head_dim": int(hf["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(hf["qk_rope_head_dim"]),
        "v_head_dim": int(hf["v_head_dim"]),
        "head_dim": int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]),
        "rope_interleave": bool(hf.get("rope_interleave", True)),
        "num_nextn_predict_layers": int(hf.get("num_nextn_predict_layers") or 0),
        "num_key_value_heads": hf["num_attention_heads"],
    }


def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or [_ARCH_BY_MODEL_TYPE.get(hf.get("model_type", ""), "?")]
    arch = archs[0]
    if arch in _REFUSED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} needs {_REFUSED_ARCHITECTURES[arch]}, which "
                         f"this engine does not run; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} (model_type {hf.get('model_type')!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _check_supported_features(hf: dict[str, Any], arch: str) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported")
    if arch in ("LlamaForCausalLM", "MistralForCausalLM") and hf.get("attention_bias"):
        raise ValueError("attention_bias=true (bias on o_proj too) is not supported for Llama")
    rope_type = _rope_params(hf).get("rope_type", _rope_params(hf).get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(_ROPE_TYPES)})")
    _check_quantization(hf)
    if hf.get("index_topk") or hf.get("index_n_heads"):
        raise ValueError("DeepSeek sparse attention (the DSA indexer: index_topk / "
                         "index_n_heads) is not supported")
    _check_layer_types(hf)


def _check_quantization(hf: dict[str, Any]) -> None:
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    if quant:
        block = (hf.get("quantization_config") or {}).get("weight_block_size")
        what = f"{quant} block quantisation {block}" if block else f"{quant} quantisation"
        raise ValueError(f"quantized checkpoints ({what}) are not supported; use bf16/fp32 "
                         "weights")


def _check_layer_types(hf: dict[str, Any]) -> None:
    layer_types = hf.get("layer_types") or []
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES})
    if unknown:
        first = next(i for i, t in enumerate(layer_types) if t in unknown)
        raise ValueError(f"layer kind(s) {', '.join(map(repr, unknown))} (layer {first} on) "
                         f"are not run by this engine; runs: {', '.join(_LAYER_TYPES)}")
    if len(layer_types) not in (0, hf.get("num_hidden_layers")):
        raise ValueError(f"{len(layer_types)} layer_types for "
                         f"{hf.get('num_hidden_layers')} layers")


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers >= 5 writes `rope_parameters` (theta included); older files use
    # `rope_theta` plus an optional `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        params.setdefault("rope_theta", hf["rope_theta"])
    return params


def _rope_scaling(hf: dict[str, Any]) -> RopeScaling | None:
    p = _rope_params(hf)
    rope_type = p.get("rope_type", p.get("type"))
    if rope_type == "yarn":
        return _yarn_scaling(hf, p)
    if rope_type != "llama3":
        return None
    return RopeScaling(
        factor=float(p["factor"]),
        low_freq_factor=float(p["low_freq_factor"]),
        high_freq_factor=float(p["high_freq_factor"]),
        original_max_position_embeddings=int(p["original_max_position_embeddings"]),
    )


def _yarn_scaling(hf: dict[str, Any], p: dict[str, Any]) -> RopeScaling:
    original = int(p["original_max_position_embeddings"])
    factor = p.get("factor") or hf.get("max_position_embeddings", original) / original
    attention_factor = p.get("attention_factor")
    return RopeScaling(
        factor=float(factor), original_max_position_embeddings=original, rope_type="yarn",
        beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
        mscale=float(p.get("mscale") or 0), mscale_all_dim=float(p.get("mscale_all_dim") or 0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(p.get("truncate", True)),
    )


def _sliding_window(hf: dict[str, Any], arch: str) -> int | None:
    window = hf.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return window
    if arch == _GPT_OSS:
        layer_types = hf.get("layer_types")
        if window is None and (not layer_types or "sliding_attention" in layer_types):
            raise ValueError("gpt-oss sliding_attention layers need a sliding_window")
        return window
    layer_types = hf.get("layer_types") or []
    sliding = [t == "sliding_attention" for t in layer_types]
    if not hf.get("use_sliding_window") and not any(sliding):
        return None
    if sliding and all(sliding) and window:
        return window
    raise ValueError("per-layer sliding-window attention (use_sliding_window) is not supported")


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def _checkpoint_dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"
