"""`pdcache export-model PRESET DIR`: a random-weight preset as a Hugging Face checkpoint.

The directory holds what `--model DIR` (pdcache/engine/loader.py) and Hugging Face clients
(`AutoConfig`, `AutoModelForCausalLM`, `AutoTokenizer`, SGLang) read:

- `config.json` (LlamaForCausalLM; DeepseekV3ForCausalLM for the MLA presets,
  GptOssForCausalLM for the gpt-oss ones, Qwen3NextForCausalLM for the qwen3-next ones) and `generation_config.json` (bos / eos / pad ids);
- `model.safetensors`: the preset's weights at `--seed`, under our (= Hugging Face's) names;
- `tokenizer.json`: a byte-level BPE without merges whose ids are exactly the byte tokenizer's
  (id b is byte b, 256.. are `<|bos|> <|eos|> <|pad|> <|im_start|> <|im_end|>`);
- `tokenizer_config.json` and `chat_template.jinja`: the special tokens and a ChatML template
  that renders to the ids of `ByteTokenizer.apply_chat_template`.

One difference remains by construction: a Hugging Face tokenizer matches special-token text
inside plain text (`"<|im_end|>"` in a prompt becomes id 260), where the byte tokenizer keeps
those bytes. Texts without special-token strings encode to the same ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from pdcache.engine.config import DTYPES, ModelConfig
from pdcache.engine.loader import load_model
from pdcache.engine.moe import split_expert_tensors
from pdcache.engine.presets import PRESETS, byte_tokenizer
from pdcache.engine.tokenizer import (
    BYTE_SPECIAL_TOKENS,
    TOOLS_INTRO,
    TOOLS_OUTRO,
    ByteTokenizer,
)

WEIGHTS_FILE = "model.safetensors"
# Files of an earlier export (or another checkpoint) that `--force` removes: a stale shard
# or index would otherwise be loaded beside the new weights.
STALE_WEIGHT_GLOBS = ("*.safetensors", "model.safetensors.index.json")

# ChatML as ByteTokenizer.apply_chat_template renders it: <|bos|>, then per message
# <|im_start|>{role}\n{content}<|im_end|>\n, then <|im_start|>assistant\n when asked; with
# `tools`, Qwen2.5's tools block in the first system message, and assistant `tool_calls` as
# <tool_call> blocks (pdcache.engine.tokenizer.render_tools_block / render_tool_calls).
_TOOLS_BLOCK = (
    "{% set ns = namespace(block=" + json.dumps(TOOLS_INTRO) + ") %}"
    "{% for tool in tools %}{% set ns.block = ns.block + '\\n' + (tool | tojson) %}{% endfor %}"
    "{% set ns.block = ns.block + " + json.dumps(TOOLS_OUTRO) + " %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + (messages[0]['content'] or '') + '\\n\\n' + ns.block"
    " + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>system\\n' + ns.block + '<|im_end|>\\n' }}{% endif %}"
)
_TOOL_CALLS = (
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + (fn['name'] | tojson) + ', \"arguments\": ' }}"
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}"
    "{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}" + _TOOLS_BLOCK + "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% if message['tool_calls'] %}" + _TOOL_CALLS + "{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ExportError(ValueError):
    """The export cannot start (unknown preset, unusable or non-empty directory)."""


def export_preset(
    name: str, out_dir: str | Path, *, seed: int = 0, dtype: str = "float32",
    force: bool = False,
) -> list[Path]:
    """Write preset `name` at `seed` (weights cast to `dtype`) as a Hugging Face checkpoint in
    `out_dir`; the files written, sorted. An existing non-empty `out_dir` is refused unless
    `force` (then our files are overwritten and stale *.safetensors removed; nothing else)."""
    out = _prepare_dir(name, Path(out_dir), dtype, force)
    model, tokenizer = load_model(name, dtype=dtype, seed=seed)
    assert isinstance(tokenizer, ByteTokenizer)
    written = [
        _write_json(out / "config.json", hf_config(model.config)),
        _write_json(out / "generation_config.json", generation_config(model.config)),
        _write_weights(out / WEIGHTS_FILE, checkpoint_tensors(model), name, seed),
        _write_tokenizer_json(out / "tokenizer.json", tokenizer),
        _write_json(out / "tokenizer_config.json", tokenizer_config(tokenizer, model.config)),
        _write_json(out / "special_tokens_map.json", special_tokens_map()),
        _write_text(out / "chat_template.jinja", CHAT_TEMPLATE),
    ]
    return sorted(written)


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under the names its family's checkpoints use: per-expert tensors
    for Qwen3-MoE / DeepSeek layouts; gpt-oss stores its fused experts as held in memory."""
    state = model.state_dict()
    moe = model.config.moe
    if moe is not None and moe.family == "gpt_oss":
        return state
    return dict(split_expert_tensors(state))


def _prepare_dir(name: str, out: Path, dtype: str, force: bool) -> Path:
    if name not in PRESETS:
        raise ExportError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"{out} is not empty; pass --force to overwrite the checkpoint "
                              "files in it")
        for pattern in STALE_WEIGHT_GLOBS:
            for stale in out.glob(pattern):
                stale.unlink()
    out.mkdir(parents=True, exist_ok=True)
    return out


def hf_config(config: ModelConfig) -> dict[str, Any]:
    """config.json of a preset: LlamaForCausalLM (DeepseekV3ForCausalLM for the MLA + MoE
    presets, GptOssForCausalLM for the gpt-oss ones), with the RoPE base both as transformers
    5 writes it (`rope_parameters`) and as older readers expect it (`rope_theta`)."""
    tok = byte_tokenizer()
    common = {
        "architectures": [config.architecture],
        "model_type": _model_type(config),
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": _rope_parameters(config),
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": tok.pad_token_id,
        "dtype": config.dtype,
        "torch_dtype": config.dtype,
        "use_cache": True,
    }
    if config.architecture == "GptOssForCausalLM":
        return {**common, **_gpt_oss_fields(config)}
    if config.architecture == "Qwen3NextForCausalLM":
        return {**common, **_qwen3_next_fields(config)}
    return {**common, **_deepseek_fields(config)} if config.is_mla else common


def _model_type(config: ModelConfig) -> str:
    if config.architecture == "GptOssForCausalLM":
        return "gpt_oss"
    if config.architecture == "Qwen3NextForCausalLM":
        return "qwen3_next"
    return "deepseek_v3" if config.is_mla else "llama"


def _qwen3_next_fields(config: ModelConfig) -> dict[str, Any]:
    """Qwen3-Next's layer kinds, DeltaNet shape, partial RoPE and MoE keys (every layer
    sparse, one shared expert)."""
    moe, lin = config.moe, config.linear_attention
    assert moe is not None and moe.family == "qwen3_next" and lin is not None
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    return {
        "layer_types": list(config.layer_types),
        "full_attention_interval": full[0] + 1 if full else config.num_hidden_layers,
        "partial_rotary_factor": config.partial_rotary_factor,
        "rope_parameters": {**_rope_parameters(config),
                            "partial_rotary_factor": config.partial_rotary_factor},
        "linear_conv_kernel_dim": lin.conv_kernel, "linear_key_head_dim": lin.key_head_dim,
        "linear_value_head_dim": lin.value_head_dim,
        "linear_num_key_heads": lin.num_key_heads,
        "linear_num_value_heads": lin.num_value_heads,
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "shared_expert_intermediate_size": moe.shared_expert_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": sorted(set(range(moe.num_layers)) - set(moe.sparse_layer_ids)),
        "norm_topk_prob": moe.norm_topk_prob, "router_aux_loss_coef": 0.0,
        "output_router_logits": False,
    }


def _gpt_oss_fields(config: ModelConfig) -> dict[str, Any]:
    """gpt-oss's layer kinds, window and MoE keys (`intermediate_size` is the experts')."""
    moe = config.moe
    assert moe is not None and moe.family == "gpt_oss", "gpt-oss presets are gpt-oss MoE"
    return {
        "layer_types": list(config.layer_types), "sliding_window": config.sliding_window,
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit,
        "router_aux_loss_coef": 0.0, "output_router_logits": False,
    }


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    s = config.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    if s.rope_type == "yarn":
        return {"rope_type": "yarn", "rope_theta": config.rope_theta, "factor": s.factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
                "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale,
                "mscale_all_dim": s.mscale_all_dim,
                # only where it differs from transformers' default (true): gpt-oss
                **({} if s.truncate else {"truncate": False})}
    return {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}


def _deepseek_fields(config: ModelConfig) -> dict[str, Any]:
    """DeepSeek-V3's attention and MoE keys (the MLA presets' routing: noaux_tc, sigmoid)."""
    moe = config.moe
    assert moe is not None and moe.family == "deepseek_v3", "MLA presets are DeepSeek-V3 MoE"
    return {
        "kv_lora_rank": config.kv_lora_rank, "q_lora_rank": config.q_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim, "v_head_dim": config.v_head_dim,
        "head_dim": config.qk_rope_head_dim, "rope_interleave": config.rope_interleave,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.moe_intermediate_size,
        "n_shared_experts": moe.n_shared_experts, "n_group": moe.n_group,
        "topk_group": moe.topk_group, "routed_scaling_factor": moe.routed_scaling_factor,
        "norm_topk_prob": moe.norm_topk_prob, "topk_method": moe.topk_method,
        "scoring_func": moe.scoring, "first_k_dense_replace": min(moe.sparse_layer_ids),
        "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
    }


def generation_config(config: ModelConfig) -> dict[str, Any]:
    """generation_config.json: stop on every eos id (`<|eos|>` and `<|im_end|>`), pad id."""
    return {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": byte_tokenizer().pad_token_id,
    }


def tokenizer_config(tok: ByteTokenizer, config: ModelConfig) -> dict[str, Any]:
    """tokenizer_config.json: PreTrainedTokenizerFast, special tokens, the chat template; no
    BOS added by `encode` and no space clean-up, so ids and text round-trip as ours do."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens_map(),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.special_ids[t]): _added_token(t) for t in BYTE_SPECIAL_TOKENS
        },
    }


def special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }


def _added_token(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of byte-level BPE (GPT-2's, which the `tokenizers`
    ByteLevel pre-tokenizer and decoder use)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_hf_tokenizer(tok: ByteTokenizer) -> Any:
    """A `tokenizers.Tokenizer` with the byte tokenizer's ids: one token per byte (BPE without
    merges over byte-level characters, no regex split) and the special tokens at 256.."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, normalized=False, special=True)
                           for t in BYTE_SPECIAL_TOKENS])
    for token in BYTE_SPECIAL_TOKENS:  # the order of BYTE_SPECIAL_TOKENS gives the ids
        assert hf.token_to_id(token) == tok.special_ids[token], token
    return hf


def _write_tokenizer_json(path: Path, tok: ByteTokenizer) -> Path:
    build_hf_tokenizer(tok).save(str(path))
    return path


def _write_weights(
    path: Path, state: dict[str, torch.Tensor], name: str, seed: int
) -> Path:
    from safetensors.torch import save

    # save() + write_bytes rather than save_file, which creates the file mode 0600.
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    metadata = {"format": "pt", "pdcache_preset": name, "pdcache_seed": str(seed)}
    path.write_bytes(save(tensors, metadata=metadata))
    return path


def _write_json(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return path


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- the `pdcache export-model` command ------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset", choices=sorted(PRESETS), help="the preset to export")
    parser.add_argument("dir", metavar="DIR", help="output directory (created; must be empty)")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="weights dtype (default float32, the preset's)")
    parser.add_argument("--force", action="store_true",
                        help="write into a non-empty DIR, overwriting the checkpoint files")


def run(args: argparse.Namespace) -> int:
    try:
        files = export_preset(args.preset, args.dir, seed=args.seed, dtype=args.dtype,
                              force=args.force)
    except ExportError as exc:
        print(f"pdcache export-model: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pdcache export-model: cannot write {args.dir}: {exc}", file=sys.stderr)
        return 1
    print(f"exported preset {args.preset} (seed {args.seed}, {args.dtype}) to {args.dir}:")
    for file in files:
        print(f"  {file.name}")
    return 0
