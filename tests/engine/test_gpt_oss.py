"""gpt-oss (`GptOssForCausalLM`) in our engine equals transformers' eager forward.

A tiny checkpoint built by transformers (fp32, fixed seed): alternating sliding-window (8) and
full layers with attention sinks, YaRN RoPE, a router with bias over 4 experts with the clamped
SwiGLU. Prompts of 40 tokens are longer than the window; every decode step attends past it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdcache.engine.api import (  # noqa: E402
    GenerateRequest,
    LogprobRequest,
    RequestOutput,
    SamplingParams,
)
from pdcache.engine.config import SUPPORTED_ARCHITECTURES, CacheConfig, EngineConfig  # noqa: E402
from pdcache.engine.engine import Engine  # noqa: E402
from pdcache.engine.export import export_preset  # noqa: E402
from pdcache.engine.kv_geometry import KVGeometry  # noqa: E402
from pdcache.engine.loader import allocate_device_kv, load_model  # noqa: E402
from pdcache.engine.moe import GptOssMoeBlock, set_moe_path  # noqa: E402
from pdcache.engine.presets import preset_config  # noqa: E402
from pdcache.engine.scheduler_config import SchedulerConfig  # noqa: E402
from tests.engine.test_model_parity import (  # noqa: E402
    _randomize,
    extend,
    hf_logits,
    write_byte_tokenizer,
)

VOCAB = 300
PAGE = 4
WINDOW = 8
ATOL = 2e-4
DECODE_STEPS = 12

GPT_OSS = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 512, "swiglu_limit": 2.0,  # a limit the activations reach
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 128},
}


def save_gpt_oss(path: Path, seed: int = 0, **changes) -> torch.nn.Module:
    config = transformers.GptOssConfig(**{**GPT_OSS, **changes})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.eval()
    model.save_pretrained(path)
    write_byte_tokenizer(path)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("gpt-oss")
    return path, save_gpt_oss(path, seed=5)


def prompt_of(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(length)]


def make_engine(path: Path, kernels: str, chunk: int = 2048) -> Engine:
    model, tokenizer = load_model(str(path))
    config = EngineConfig(
        model=model.config,
        cache=CacheConfig(page_size=PAGE, num_device_pages=128),
        scheduler=SchedulerConfig(chunked_prefill_tokens=chunk),
        kernels=kernels,
    )
    return Engine(config, model, tokenizer)


def generate(engine: Engine, rid: str, prompt: list[int]) -> list[RequestOutput]:
    params = SamplingParams(max_new_tokens=DECODE_STEPS, ignore_eos=True)
    request = GenerateRequest(rid, prompt, params, logprobs=LogprobRequest(top_n=VOCAB))
    outputs = engine.generate(request, timeout=120)
    assert outputs[-1].finished
    return outputs


def assert_matches_transformers(hf: torch.nn.Module, prompt: list[int],
                                outputs: list[RequestOutput]) -> None:
    """Our greedy tokens are transformers' argmax at every step, and our log-probabilities of
    every vocabulary entry (the logits up to a constant) equal its log_softmax."""
    tokens = [t for out in outputs for t in out.new_token_ids]
    entries = [e for out in outputs for e in out.new_logprobs]
    assert len(tokens) == len(entries) == DECODE_STEPS
    expected = hf_logits(hf, prompt + tokens)[len(prompt) - 1 : -1].log_softmax(-1)
    assert tokens == expected.argmax(-1).tolist()
    ours = torch.full_like(expected, float("nan"))
    for row, entry in enumerate(entries):
        for token_id, logprob in entry.top:
            ours[row, token_id] = logprob
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=1e-4)


# ---- config, geometry, refusals ------------------------------------------------------------

def test_config_reads_layer_kinds_window_sinks_and_moe(checkpoint) -> None:
    path, _ = checkpoint
    config = load_model(str(path))[0].config
    assert config.architecture == "GptOssForCausalLM" and config.attention_sinks
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert [config.layer_window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert config.o_proj_bias and config.attention_bias
    assert config.rope_scaling is not None and not config.rope_scaling.truncate
    moe = config.moe
    assert moe is not None and (moe.family, moe.num_experts, moe.top_k) == ("gpt_oss", 4, 2)
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (1.702, 2.0)
    geometry = config.kv_geometry
    assert geometry.layer_kinds == ("sliding", "full", "sliding", "full")
    assert geometry.sliding_window == WINDOW and geometry.sliding_layers == (0, 2)
    # the bytes are a plain K/V cache's (every layer still keeps all its pages) ...
    plain = KVGeometry.mha(4, 2, 16, "float32")
    assert geometry.token_bytes == plain.token_bytes
    assert geometry.page_shape(PAGE) == plain.page_shape(PAGE)
    # ... but pages of another window or layer mix never match
    assert geometry.fingerprint("m", PAGE) != plain.fingerprint("m", PAGE)
    assert "layer_kinds=SFSF;window=8" in geometry.fingerprint("m", PAGE)
    other_window = plain.with_layer_kinds(geometry.layer_kinds, 16)
    assert other_window.fingerprint("m", PAGE) != geometry.fingerprint("m", PAGE)
    assert "2 sliding, window 8" in geometry.describe()


def test_an_architecture_we_do_not_run_is_refused_naming_it_and_what_runs(tmp_path) -> None:
    save_gpt_oss(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="DeepseekV32ForCausalLM") as err:
        load_model(str(tmp_path))
    assert "DSA indexer" in str(err.value)
    assert all(arch in str(err.value) for arch in SUPPORTED_ARCHITECTURES)
    assert "GptOssForCausalLM" in SUPPORTED_ARCHITECTURES


def test_a_layer_kind_we_do_not_run_is_refused_naming_it(tmp_path) -> None:
    save_gpt_oss(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"][3] = "linear_attention"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'linear_attention' \(layer 3 on\).*sliding_attention"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"\['recurrent'\] are not run by this engine"):
        KVGeometry.mha(2, 1, 8, "float32").with_layer_kinds(("full", "recurrent"))
    with pytest.raises(ValueError, match="positive sliding_window"):
        KVGeometry.mha(2, 1, 8, "float32").with_layer_kinds(("full", "sliding"))


def test_mxfp4_weights_are_refused(tmp_path) -> None:
    save_gpt_oss(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mxfp4 quantisation"):
        load_model(str(tmp_path))


# ---- the forward ---------------------------------------------------------------------------

def test_forward_with_a_cached_prefix_equals_transformers(checkpoint) -> None:
    """Logits of every position: a cold 40-token prompt, then the same prompt as a cached
    prefix (ending mid-page and mid-window) plus chunks, with the reference MoE path too."""
    path, hf = checkpoint
    model = load_model(str(path))[0]
    prompt = prompt_of(1, 40)
    expected = hf_logits(hf, prompt)
    pages = torch.randperm(16, generator=torch.Generator().manual_seed(2))
    for moe_path in ("fast", "reference"):
        set_moe_path(model, moe_path)
        kv = allocate_device_kv(model.config, num_pages=16, page_size=PAGE)
        cold = extend(model, kv, prompt, 0, pages)
        torch.testing.assert_close(cold, expected, atol=ATOL, rtol=1e-4)
        kv.zero_()
        parts = [extend(model, kv, prompt[a:b], a, pages) for a, b in ((0, 13), (13, 30),
                                                                        (30, 39), (39, 40))]
        torch.testing.assert_close(torch.cat(parts), expected, atol=ATOL, rtol=1e-4)
    assert any(isinstance(m, GptOssMoeBlock) for m in model.modules())


def test_the_sinks_and_the_window_matter(checkpoint) -> None:
    """Guards the parity tests: without the sinks, or without the window, logits change."""
    path, hf = checkpoint
    prompt = prompt_of(3, 40)
    expected = hf_logits(hf, prompt)
    for change in ("sinks", "window"):
        model = load_model(str(path))[0]
        for layer in model.model.layers:
            if change == "sinks":
                layer.self_attn.sinks.data.zero_()
            else:
                layer.self_attn.sliding_window = None
        kv = allocate_device_kv(model.config, num_pages=16, page_size=PAGE)
        got = extend(model, kv, prompt, 0, torch.arange(16))
        assert (got - expected).abs().max() > 0.05, change


def test_bfloat16_load_runs_close_to_fp32(checkpoint) -> None:
    """bf16 weights (sinks included) run on every path; not bit-equal to transformers, whose
    RMSNorm weights stay fp32 (docs/design.md §4.14)."""
    path, _ = checkpoint
    prompt = prompt_of(4, 40)
    logits = []
    for dtype in ("float32", "bfloat16"):
        model = load_model(str(path), dtype=dtype)[0]
        assert model.model.layers[0].self_attn.sinks.dtype == model.config.torch_dtype
        kv = allocate_device_kv(model.config, num_pages=16, page_size=PAGE)
        extend(model, kv, prompt[:20], 0, torch.arange(16))
        logits.append(extend(model, kv, prompt[20:], 20, torch.arange(16)))
    assert (logits[0] - logits[1]).abs().max() < 0.1 * logits[0].abs().max()


# ---- through the engine --------------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["reference", "torch"])
def test_engine_greedy_tokens_and_logits_equal_transformers(checkpoint, kernels: str) -> None:
    """A cold 40-token prompt (5 windows), then a prompt extending it: the second reuses its
    10 cached pages (the sliding layers' pages of the window before the prompt's end are
    kept; a hit inside the prompt is `test_sliding_window_pages.py`'s). Both decode 12
    steps, every one past the window; prefill runs in chunks of 12 so chunks start
    mid-window on cached keys."""
    path, hf = checkpoint
    first = prompt_of(7, 40)
    second = first + prompt_of(8, 8)
    with make_engine(path, kernels, chunk=12) as engine:
        cold = generate(engine, "cold", first)
        assert cold[-1].cached.total == 0
        hit = generate(engine, "hit", second)
        assert hit[-1].cached.device == 40
        short = generate(engine, "short", prompt_of(9, 5))  # decode crosses the window
    assert_matches_transformers(hf, first, cold)
    assert_matches_transformers(hf, second, hit)
    assert_matches_transformers(hf, prompt_of(9, 5), short)


# ---- presets -------------------------------------------------------------------------------

def test_tiny_preset_exports_as_gpt_oss_that_transformers_runs_as_we_do(tmp_path: Path) -> None:
    """`pdcache export-model tiny-gpt-oss`: transformers loads a GptOssForCausalLM whose
    logits equal ours and whose greedy tokens are our engine's; our loader reads the
    checkpoint back to the preset's exact weights."""
    export_preset("tiny-gpt-oss", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"]) == ("gpt_oss", 16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    ours = load_model("tiny-gpt-oss")[0]
    back = load_model(str(tmp_path))[0]
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(),
                                                 back.state_dict().values(), strict=True))
    prompt = prompt_of(11, 40)
    kv = allocate_device_kv(ours.config, num_pages=32, page_size=PAGE)
    got = extend(ours, kv, prompt, 0, torch.arange(32))
    torch.testing.assert_close(got, hf_logits(hf, prompt), atol=ATOL, rtol=1e-4)
    theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    cache = CacheConfig(page_size=PAGE, num_device_pages=64)
    with Engine.from_spec("tiny-gpt-oss", cache=cache) as engine:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        outputs = engine.generate(GenerateRequest("p", prompt, params), timeout=120)
    assert [t for out in outputs for t in out.new_token_ids] == theirs[0, len(prompt):].tolist()


def test_presets_have_the_gpt_oss_shape() -> None:
    for name, window in (("tiny-gpt-oss", 16), ("small-gpt-oss", 128)):
        config = preset_config(name)
        kinds = config.kv_geometry.layer_kinds
        assert kinds == ("sliding", "full") * (config.num_hidden_layers // 2), name
        assert config.kv_geometry.sliding_window == window and config.attention_sinks
