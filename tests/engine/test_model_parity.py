"""Our forward equals transformers' on the same random weights, loaded from safetensors."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

transformers = pytest.importorskip("transformers")

from pdcache.engine.config import SUPPORTED_ARCHITECTURES  # noqa: E402
from pdcache.engine.forward import ForwardBatch, ForwardMode  # noqa: E402
from pdcache.engine.loader import allocate_device_kv, load_model  # noqa: E402
from pdcache.engine.tokenizer import HFTokenizer  # noqa: E402

VOCAB = 300
PAGE = 4
ATOL = 2e-4

SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

CASES = {
    "llama": (transformers.LlamaConfig, {"rope_theta": 10000.0}),
    "llama3-rope-tied": (
        transformers.LlamaConfig,
        {
            "rope_theta": 50000.0,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2": (transformers.Qwen2Config, {"rope_theta": 1e6}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 24, "rope_theta": 1e6}),
    "mistral-sliding": (transformers.MistralConfig, {"sliding_window": 8, "head_dim": 16}),
    # GQA + MoE: softmax top-k routing (Qwen3-MoE with q/k norm, Mixtral)
    "qwen3-moe": (transformers.Qwen3MoeConfig, {
        "head_dim": 16, "rope_theta": 1e6, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "mixtral": (transformers.MixtralConfig, {
        "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6}),
    # MLA + MoE (DeepSeek-V3 / Kimi K2): q and kv LoRA, decoupled RoPE on interleaved pairs
    # with DeepSeek's YaRN (mscale in cos/sin and in the softmax scale); a dense first layer,
    # then grouped top-k routing with the correction bias, scaling, a shared expert
    "deepseek-v3-mla": (transformers.DeepseekV3Config, {
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 12, "first_k_dense_replace": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}}),
    # DeepSeek-V2-Lite's shape: one q projection (no q LoRA), plain RoPE, greedy softmax top-k
    "deepseek-v2-mla": (transformers.DeepseekV2Config, {
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "n_shared_experts": 1, "topk_method": "greedy", "rope_theta": 10000.0}),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF's 0.02-std init gives near-zero logits; O(1) weights make every mistake visible.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # fan-in is the last dim (experts' fused weights are [E, out, in])
                p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))


def save_hf_model(path: Path, case: str, seed: int = 0) -> torch.nn.Module:
    config_cls, extra = CASES[case]
    config = config_cls(**{**SMALL, **extra})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return model


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level BPE (no merges) tokenizer.json plus a ChatML tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {"chat_template": template, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def extend(model, kv, ids: list[int], start: int, pages: torch.Tensor) -> torch.Tensor:
    """Run tokens at positions start.. of one sequence (all logits rows returned)."""
    n = len(ids)
    positions = torch.arange(start, start + n)
    slots = pages[positions // PAGE] * PAGE + positions % PAGE
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=torch.tensor(ids),
        positions=positions,
        out_slots=slots,
        page_table=pages[None],
        prefix_lens=[start],
        extend_lens=[n],
        logits_indices=torch.arange(n),
    )
    with torch.inference_mode():
        return model(batch, kv)


def our_model(path: Path):
    model, tokenizer = load_model(str(path))
    kv = allocate_device_kv(model.config, num_pages=32, page_size=PAGE)
    pages = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    return model, tokenizer, kv, pages


PROMPT = [(i * 37 + 11) % VOCAB for i in range(29)]


@pytest.mark.parametrize("case", list(CASES))
def test_full_prompt_logits_match_transformers(tmp_path: Path, case: str) -> None:
    hf = save_hf_model(tmp_path, case)
    model, _, kv, pages = our_model(tmp_path)
    expected = hf_logits(hf, PROMPT)
    got = extend(model, kv, PROMPT, 0, pages)
    assert expected.abs().max() > 1.0  # logits are not trivially tiny
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_after_cached_prefix_match_transformers(tmp_path: Path, case: str) -> None:
    hf = save_hf_model(tmp_path, case, seed=3)
    model, _, kv, pages = our_model(tmp_path)
    expected = hf_logits(hf, PROMPT)
    extend(model, kv, PROMPT[:10], 0, pages)  # prefix ends mid-page
    got_tail = extend(model, kv, PROMPT[10:27], 10, pages)
    got_decode = extend(model, kv, PROMPT[27:28], 27, pages)
    torch.testing.assert_close(got_tail, expected[10:27], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_decode, expected[27:28], atol=ATOL, rtol=1e-4)


def test_loaded_config_reflects_variant(tmp_path: Path) -> None:
    save_hf_model(tmp_path / "q3", "qwen3")
    save_hf_model(tmp_path / "l3", "llama3-rope-tied")
    save_hf_model(tmp_path / "q2", "qwen2")
    q3 = load_model(str(tmp_path / "q3"))[0].config
    l3 = load_model(str(tmp_path / "l3"))[0].config
    q2 = load_model(str(tmp_path / "q2"))[0].config
    assert (q3.architecture, q3.qk_norm, q3.head_dim) == ("Qwen3ForCausalLM", True, 24)
    assert l3.tie_word_embeddings and l3.rope_scaling is not None and l3.rope_theta == 50000.0
    assert q2.attention_bias and not q2.qk_norm


def test_bfloat16_load_runs_close_to_fp32(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "llama")
    model32, _, kv32, pages = our_model(tmp_path)
    model16, _ = load_model(str(tmp_path), dtype="bfloat16")
    assert model16.model.embed_tokens.weight.dtype == torch.bfloat16
    kv16 = allocate_device_kv(model16.config, num_pages=32, page_size=PAGE)
    assert kv16.dtype == torch.bfloat16
    a = extend(model32, kv32, PROMPT, 0, pages)
    b = extend(model16, kv16, PROMPT, 0, pages)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_tokenizer_json_and_chat_template_load(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "qwen2")
    _, tok = load_model(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    text = "héllo wörld"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) == len(text.encode("utf-8"))
    im_end = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).token_to_id("<|im_end|>")
    assert im_end in tok.eos_token_ids
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids.count(im_end) == 1


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "llama")
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(str(tmp_path))


def test_missing_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "llama")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    _, tok = load_model(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsupported_architecture_names_supported_ones(tmp_path: Path) -> None:
    save_hf_model(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        load_model(str(tmp_path))
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)


def test_missing_tensor_is_a_clear_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_hf_model(tmp_path, "llama")
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.mlp\.up_proj"):
        load_model(str(tmp_path))


def test_unknown_model_spec_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(str(tmp_path / "nope"))


def test_engine_bench_tiny_matches_transformers_tokens(tmp_path: Path) -> None:
    """The benchmark's contenders run the same weights: greedy tokens agree, JSON is written."""
    from pdcache.bench import engine_bench

    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    parser.add_argument("--json", dest="json_path")
    out = tmp_path / "engine.json"
    args = parser.parse_args(
        ["--preset", "tiny", "--prompt-len", "40", "--decode-steps", "4", "--repeats", "1",
         "--chunk", "16", "--margin-steps", "8", "--json", str(out)]
    )
    assert engine_bench.run(args) == 0
    result = json.loads(out.read_text())
    names = [row["engine"] for row in result["rows"]]
    assert names == ["pdcache", "pdcache chunked 16", "transformers eager", "transformers sdpa"]
    assert all(row["same_greedy_tokens"] for row in result["rows"])
    assert result["max_abs_logit_diff"] < 1e-4 < result["min_top1_top2_margin"]


def test_config_and_tokenizer_load_without_weights(tmp_path: Path) -> None:
    from pdcache.engine.loader import load_model_config, load_tokenizer

    save_hf_model(tmp_path, "qwen3")
    model, tok = load_model(str(tmp_path))
    assert load_model_config(str(tmp_path)) == model.config
    assert load_tokenizer(str(tmp_path)).encode("abc") == tok.encode("abc")
    assert load_model_config("tiny", seed=3) == load_model("tiny", seed=3)[0].config
    with pytest.raises(ValueError, match="neither a preset"):
        load_model_config(str(tmp_path / "nope"))


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, feature", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     r"fp8 block quantisation \[128, 128\]"),
    ({"index_topk": 2048, "index_n_heads": 64}, "DSA indexer"),
    ({"architectures": ["DeepseekV32ForCausalLM"]}, "DeepSeek sparse attention"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
     "rope_type 'longrope'"),
    ({"scoring_func": "tanh"}, "tanh"),
])
def test_a_checkpoint_feature_we_do_not_run_is_refused_by_name(tmp_path: Path, changes,
                                                                 feature) -> None:
    save_hf_model(tmp_path, "deepseek-v3-mla")
    load_model(str(tmp_path))  # loads as saved
    _edit_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=feature):
        load_model(str(tmp_path))


def test_mtp_layers_past_the_decoder_are_left_out(tmp_path: Path) -> None:
    """DeepSeek-V3 checkpoints carry their multi-token-prediction module as layer 61 of 61:
    its tensors are not loaded (we do not decode speculatively) and the model is unchanged."""
    from safetensors.torch import load_file, save_file

    hf = save_hf_model(tmp_path, "deepseek-v3-mla")
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    mtp = {k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in tensors.items()
           if k.startswith("model.layers.1.")}
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
    _edit_config(tmp_path, num_nextn_predict_layers=1)
    model, _, kv, pages = our_model(tmp_path)
    assert len(model.model.layers) == 2
    got = extend(model, kv, PROMPT, 0, pages)
    torch.testing.assert_close(got, hf_logits(hf, PROMPT), atol=ATOL, rtol=1e-4)
    # a layer past the decoder that the config does not call MTP fails the load
    _edit_config(tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"unexpected tensor model\.layers\.2\."):
        load_model(str(tmp_path))


def test_engine_bench_mla_preset_matches_transformers_tokens(tmp_path: Path) -> None:
    """`pdcache bench engine --preset tiny-mla` runs transformers' DeepseekV3 on our weights:
    the same greedy tokens."""
    from pdcache.bench import engine_bench

    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    parser.add_argument("--json", dest="json_path")
    out = tmp_path / "engine.json"
    args = parser.parse_args(
        ["--preset", "tiny-mla", "--prompt-len", "40", "--decode-steps", "4", "--repeats", "1",
         "--chunk", "16", "--margin-steps", "0", "--json", str(out)])
    assert engine_bench.run(args) == 0
    assert all(row["same_greedy_tokens"] for row in json.loads(out.read_text())["rows"])
