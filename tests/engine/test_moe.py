"""Sparse MoE blocks equal transformers' on random O(1) weights; config and checkpoint names."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v2 import modeling_deepseek_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3  # noqa: E402
from transformers.models.mixtral import modeling_mixtral  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

from pdcache.engine.moe import (  # noqa: E402
    DenseMLP,
    ForwardPath,
    MoEConfig,
    SparseMoeBlock,
    convert_checkpoint_tensors,
    make_mlp,
    moe_config_from_hf,
    set_moe_path,
)

HIDDEN = 64
EXPERTS = 8
TOP_K = 2
MOE_WIDTH = 32
DENSE_WIDTH = 96
ATOL = 1e-5
RTOL = 1e-5

TINY = {
    "vocab_size": 48,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}
MLA = {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
MLA_V = {**MLA, "v_head_dim": 16}


def _qwen3_moe(**overrides: Any) -> Any:
    settings = {
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_WIDTH,
        "intermediate_size": DENSE_WIDTH,
        "norm_topk_prob": True,
        **overrides,
    }
    return transformers.Qwen3MoeConfig(**TINY, **settings)


def _mixtral(**overrides: Any) -> Any:
    settings = {
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "intermediate_size": MOE_WIDTH,
        **overrides,
    }
    return transformers.MixtralConfig(**TINY, **settings)


def _deepseek_v3(**overrides: Any) -> Any:
    settings = {
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_WIDTH,
        "intermediate_size": DENSE_WIDTH,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        **MLA_V,
        **overrides,
    }
    return transformers.DeepseekV3Config(**TINY, **settings)


def _deepseek_v2(**overrides: Any) -> Any:
    settings = {
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "moe_intermediate_size": MOE_WIDTH,
        "intermediate_size": DENSE_WIDTH,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "topk_method": "greedy",
        **MLA_V,
        **overrides,
    }
    return transformers.DeepseekV2Config(**TINY, **settings)


# architecture -> transformers' decoder layer (whose `mlp` is the block under test)
HF_LAYERS: dict[str, Callable[..., nn.Module]] = {
    "Qwen3MoeForCausalLM": modeling_qwen3_moe.Qwen3MoeDecoderLayer,
    "MixtralForCausalLM": modeling_mixtral.MixtralDecoderLayer,
    "DeepseekV3ForCausalLM": modeling_deepseek_v3.DeepseekV3DecoderLayer,
    "DeepseekV2ForCausalLM": modeling_deepseek_v2.DeepseekV2DecoderLayer,
}

# case -> (architecture, config factory, layer id)
SPARSE_CASES: dict[str, tuple[str, Callable[[], Any], int]] = {
    "qwen3_moe-norm": ("Qwen3MoeForCausalLM", _qwen3_moe, 0),
    "qwen3_moe-unnormalised": ("Qwen3MoeForCausalLM", lambda: _qwen3_moe(norm_topk_prob=False), 2),
    "mixtral": ("MixtralForCausalLM", _mixtral, 1),
    "deepseek_v3": ("DeepseekV3ForCausalLM", _deepseek_v3, 1),
    "deepseek_v3-unnormalised": (
        "DeepseekV3ForCausalLM",
        lambda: _deepseek_v3(norm_topk_prob=False),
        3,
    ),
    "deepseek_v2-greedy": ("DeepseekV2ForCausalLM", _deepseek_v2, 1),
    "deepseek_v2-group_limited": (
        "DeepseekV2ForCausalLM",
        lambda: _deepseek_v2(topk_method="group_limited_greedy", n_group=4, topk_group=1),
        2,
    ),
}
DENSE_CASES: dict[str, tuple[str, Callable[[], Any], int]] = {
    "deepseek_v3-first_k_dense": ("DeepseekV3ForCausalLM", _deepseek_v3, 0),
    "deepseek_v2-first_k_dense": ("DeepseekV2ForCausalLM", _deepseek_v2, 0),
    "qwen3_moe-mlp_only_layers": (
        "Qwen3MoeForCausalLM",
        lambda: _qwen3_moe(mlp_only_layers=[2]),
        2,
    ),
    "qwen3_moe-decoder_sparse_step": (
        "Qwen3MoeForCausalLM",
        lambda: _qwen3_moe(decoder_sparse_step=2),
        0,
    ),
}


def _randomize(module: nn.Module, seed: int) -> None:
    # HF's 0.02-std init hides mistakes; 1/sqrt(fan_in) keeps activations O(1). The
    # correction bias is as large as the score spread, so it changes which experts win.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(noise * 0.5)
            else:
                tensor.copy_(noise / tensor.shape[-1] ** 0.5)


def _hf_mlp(architecture: str, config: Any, layer_id: int, seed: int = 0) -> nn.Module:
    config._experts_implementation = "eager"
    layer = HF_LAYERS[architecture](config, layer_id)
    _randomize(layer.mlp, seed)
    return layer.mlp.eval()


def _our_mlp(architecture: str, config: Any, layer_id: int) -> nn.Module:
    moe = moe_config_from_hf(config.to_dict(), architecture)
    return make_mlp(moe, config.hidden_size, config.intermediate_size, layer_id).eval()


def _tokens(seed: int, batch: int = 3, seq: int = 17) -> torch.Tensor:
    return torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _pair(case: tuple[str, Callable[[], Any], int]) -> tuple[nn.Module, nn.Module]:
    architecture, make_config, layer_id = case
    config = make_config()
    hf = _hf_mlp(architecture, config, layer_id)
    ours = _our_mlp(architecture, config, layer_id)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@torch.no_grad()
def _run(block: SparseMoeBlock, x: torch.Tensor, path: ForwardPath) -> torch.Tensor:
    block.path = path
    return block(x.reshape(-1, HIDDEN))


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_block_matches_transformers(case: str) -> None:
    hf, ours = _pair(SPARSE_CASES[case])
    assert isinstance(ours, SparseMoeBlock)
    assert ours.state_dict().keys() == hf.state_dict().keys()
    x = _tokens(1)
    with torch.no_grad():
        expected = hf(x).reshape(-1, HIDDEN)
    fast = _run(ours, x, "fast")
    reference = _run(ours, x, "reference")
    torch.testing.assert_close(fast, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(reference, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(fast, reference, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_router_matches_transformers(case: str) -> None:
    hf, ours = _pair(SPARSE_CASES[case])
    x = _tokens(2).reshape(-1, HIDDEN)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
        our_ids, our_weights = ours.gate(x)
    # DeepSeek picks with sorted=False: compare each token's choices in expert order.
    hf_ids, hf_order = hf_ids.sort(dim=-1)
    our_ids, our_order = our_ids.sort(dim=-1)
    assert torch.equal(our_ids, hf_ids)
    torch.testing.assert_close(
        our_weights.gather(1, our_order), hf_weights.gather(1, hf_order), atol=0, rtol=0
    )


@pytest.mark.parametrize("case", list(DENSE_CASES))
def test_dense_layer_matches_transformers(case: str) -> None:
    hf, ours = _pair(DENSE_CASES[case])
    assert isinstance(ours, DenseMLP)
    assert not hasattr(hf, "experts")
    x = _tokens(3)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=ATOL, rtol=RTOL)


def test_set_moe_path_switches_blocks_and_paths_agree() -> None:
    _, ours = _pair(SPARSE_CASES["deepseek_v3"])
    model = nn.Sequential(ours)
    x = _tokens(4).reshape(-1, HIDDEN)
    with torch.no_grad():
        set_moe_path(model, "reference")
        assert ours.path == "reference"
        reference = model(x)
        set_moe_path(model, "fast")
        assert ours.path == "fast"
        torch.testing.assert_close(model(x), reference, atol=ATOL, rtol=RTOL)
        assert model(x[:0]).shape == (0, HIDDEN)  # an empty batch routes nothing
        ours.path = "slow"  # type: ignore[assignment]
        with pytest.raises(ValueError, match="slow"):
            ours(x)


def _plain_topk(scores: torch.Tensor) -> torch.Tensor:
    return scores.topk(TOP_K, dim=-1)[1].sort(dim=-1)[0]


def test_correction_bias_and_groups_steer_the_choice() -> None:
    # Would the parity test notice a router that ignored the bias or the groups? Only if,
    # on this data, both change which experts are picked.
    hf, ours = _pair(SPARSE_CASES["deepseek_v3"])
    x = _tokens(5).reshape(-1, HIDDEN)
    with torch.no_grad():
        chosen = ours.gate(x)[0].sort(dim=-1)[0]
        scores = torch.sigmoid(x @ ours.gate.weight.T)
        biased = scores + ours.gate.e_score_correction_bias
        assert (chosen != _plain_topk(biased)).any(), "n_group/topk_group never matter here"
        expected = hf(x)
        ours.gate.e_score_correction_bias.zero_()
        unbiased_choice = ours.gate(x)[0].sort(dim=-1)[0]
        assert (chosen != unbiased_choice).any(), "the bias never changes the choice here"
        assert not torch.allclose(ours(x), expected, atol=1e-3)


def test_group_limited_greedy_steers_the_choice() -> None:
    _, ours = _pair(SPARSE_CASES["deepseek_v2-group_limited"])
    x = _tokens(6).reshape(-1, HIDDEN)
    with torch.no_grad():
        chosen = ours.gate(x)[0].sort(dim=-1)[0]
        scores = torch.softmax(x @ ours.gate.weight.T, dim=-1)
    assert (chosen != _plain_topk(scores)).any()
    groups = chosen // (EXPERTS // 4)
    assert (groups[:, 0] == groups[:, 1]).all()  # topk_group=1: both from one group


@pytest.mark.parametrize("case", ["qwen3_moe-norm", "mixtral", "deepseek_v3", "deepseek_v2-greedy"])
def test_bfloat16_matches_transformers(case: str) -> None:
    hf, ours = _pair(SPARSE_CASES[case])
    fp32_router = {name: t.clone() for name, t in hf.gate.state_dict().items()}
    hf.to(torch.bfloat16)
    ours.to(torch.bfloat16)  # must keep a DeepSeek router's fp32 values, unrounded
    deepseek = case.startswith("deepseek")
    if deepseek:  # what from_pretrained's _keep_in_fp32_modules_strict leaves in fp32
        hf.gate.float().load_state_dict(fp32_router)
    router_dtype = torch.float32 if deepseek else torch.bfloat16
    assert {p.dtype for p in ours.gate.parameters()} == {router_dtype}
    assert ours.experts.gate_up_proj.dtype == torch.bfloat16
    x = _tokens(7).to(torch.bfloat16)
    with torch.no_grad():
        expected = hf(x).reshape(-1, HIDDEN)
    # The fast path runs transformers' ops in transformers' order: bit-exact, so a dtype
    # promotion slip (weights cast to bf16 before the product, say) shows.
    torch.testing.assert_close(_run(ours, x, "fast"), expected, atol=0, rtol=0)
    torch.testing.assert_close(_run(ours, x, "reference"), expected, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# config.json


def _sparse_layers_of_transformers(architecture: str, config: Any) -> set[int]:
    config._experts_implementation = "eager"
    layers = [HF_LAYERS[architecture](config, i) for i in range(config.num_hidden_layers)]
    return {i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts")}


@pytest.mark.parametrize(
    ("architecture", "make_config"),
    [
        ("Qwen3MoeForCausalLM", lambda: _qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3])),
        ("Qwen3MoeForCausalLM", lambda: _qwen3_moe(mlp_only_layers=[0, 2])),
        ("MixtralForCausalLM", _mixtral),
        ("DeepseekV3ForCausalLM", lambda: _deepseek_v3(first_k_dense_replace=2)),
        ("DeepseekV2ForCausalLM", _deepseek_v2),
    ],
)
def test_sparse_layers_match_transformers(
    architecture: str, make_config: Callable[[], Any]
) -> None:
    config = make_config()
    moe = moe_config_from_hf(config.to_dict(), architecture)
    assert moe is not None
    sparse = {i for i in range(config.num_hidden_layers) if moe.is_sparse(i)}
    assert sparse == _sparse_layers_of_transformers(architecture, config)
    assert sparse != set(range(config.num_hidden_layers)) or architecture == "MixtralForCausalLM"
    with pytest.raises(ValueError, match="outside"):
        moe.is_sparse(config.num_hidden_layers)


def test_config_from_transformers_configs() -> None:
    qwen = moe_config_from_hf(_qwen3_moe().to_dict(), "Qwen3MoeForCausalLM")
    assert qwen == MoEConfig(
        family="qwen3_moe",
        scoring="softmax",
        topk_method="greedy",
        num_experts=EXPERTS,
        top_k=TOP_K,
        moe_intermediate_size=MOE_WIDTH,
        dense_intermediate_size=DENSE_WIDTH,
        norm_topk_prob=True,
        num_layers=4,
        sparse_layer_ids=frozenset(range(4)),
    )
    mixtral = moe_config_from_hf(_mixtral().to_dict(), "MixtralForCausalLM")
    assert mixtral is not None
    assert (mixtral.num_experts, mixtral.top_k, mixtral.moe_intermediate_size) == (8, 2, 32)
    assert mixtral.norm_topk_prob and mixtral.n_shared_experts == 0
    v3 = moe_config_from_hf(_deepseek_v3().to_dict(), "DeepseekV3ForCausalLM")
    assert v3 == MoEConfig(
        family="deepseek_v3",
        scoring="sigmoid",
        topk_method="noaux_tc",
        num_experts=EXPERTS,
        top_k=TOP_K,
        moe_intermediate_size=MOE_WIDTH,
        dense_intermediate_size=DENSE_WIDTH,
        norm_topk_prob=True,
        num_layers=4,
        sparse_layer_ids=frozenset({1, 2, 3}),
        routed_scaling_factor=2.5,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
    )
    v2 = moe_config_from_hf(
        _deepseek_v2(topk_method="group_limited_greedy", n_group=4, topk_group=1).to_dict(),
        "DeepseekV2ForCausalLM",
    )
    assert v2 is not None
    assert (v2.scoring, v2.topk_method, v2.n_group, v2.topk_group) == (
        "softmax",
        *("group_limited_greedy", 4, 1),
    )
    assert (v2.n_shared_experts, v2.routed_scaling_factor, v2.norm_topk_prob) == (2, 2.5, False)
    assert moe_config_from_hf(transformers.LlamaConfig().to_dict(), "LlamaForCausalLM") is None


def _hub_deepseek_v3(**overrides: Any) -> dict[str, Any]:
    # The remote-code fields of deepseek-ai/DeepSeek-V3's config.json (shrunk).
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": HIDDEN,
        "intermediate_size": DENSE_WIDTH,
        "moe_intermediate_size": MOE_WIDTH,
        "num_hidden_layers": 6,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "num_experts_per_tok": TOP_K,
        "n_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        **overrides,
    }


def test_config_from_hub_style_dicts() -> None:
    v3 = moe_config_from_hf(_hub_deepseek_v3(), "DeepseekV3ForCausalLM")
    assert v3 is not None and v3.sparse_layer_ids == {3, 4, 5}
    # DeepSeek's reference code honours moe_layer_freq (every released checkpoint uses 1).
    every_other = moe_config_from_hf(_hub_deepseek_v3(moe_layer_freq=2), "DeepseekV3ForCausalLM")
    assert every_other is not None and every_other.sparse_layer_ids == {4}
    kimi = _hub_deepseek_v3(model_type="kimi_k2", n_group=1, topk_group=1, first_k_dense_replace=1)
    kimi_moe = moe_config_from_hf(kimi, "DeepseekV3ForCausalLM")
    assert kimi_moe is not None and (kimi_moe.n_group, kimi_moe.topk_group) == (1, 1)
    qwen_hub = {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }
    qwen = moe_config_from_hf(qwen_hub, "Qwen3MoeForCausalLM")
    assert qwen is not None and qwen.num_experts == 128 and len(qwen.sparse_layer_ids) == 48


@pytest.mark.parametrize(
    ("architecture", "hf", "named"),
    [
        ("DeepseekV3ForCausalLM", _hub_deepseek_v3(scoring_func="tanh"), "tanh"),
        ("DeepseekV3ForCausalLM", _hub_deepseek_v3(scoring_func="softmax"), "softmax"),
        ("DeepseekV3ForCausalLM", _hub_deepseek_v3(topk_method="greedy"), "greedy"),
        (
            "DeepseekV2ForCausalLM",
            _hub_deepseek_v3(topk_method="noaux_tc", scoring_func=None),
            "noaux_tc",
        ),
        (
            "DeepseekV2ForCausalLM",
            _hub_deepseek_v3(topk_method="top_p", scoring_func=None),
            "top_p",
        ),
        (
            "DeepseekV2ForCausalLM",
            _hub_deepseek_v3(topk_method=None, scoring_func="sigmoid"),
            "sigmoid",
        ),
        (
            "DeepseekV2ForCausalLM",
            _hub_deepseek_v3(topk_method=None, scoring_func=None),
            "norm_topk_prob",
        ),
        ("DeepseekV3ForCausalLM", _hub_deepseek_v3(hidden_act="gelu"), "gelu"),
        ("DeepseekV2ForCausalLM", {**_hub_deepseek_v3(), "mlp_bias": True}, "mlp_bias"),
        ("MixtralForCausalLM", {"num_local_experts": 8, "hidden_act": "relu"}, "relu"),
        ("Qwen2MoeForCausalLM", {"num_experts": 60}, "Qwen2MoeForCausalLM"),
        ("DeepseekV3ForCausalLM", _hub_deepseek_v3(n_group=None), "n_group"),
    ],
)
def test_config_refuses_what_it_does_not_run(
    architecture: str, hf: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        moe_config_from_hf(hf, architecture)


# ---------------------------------------------------------------------------------------------
# checkpoint names

CAUSAL_LMS: dict[str, tuple[Callable[[Any], nn.Module], Callable[[], Any], str]] = {
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, _qwen3_moe, "mlp.experts.0.gate_proj.weight"),
    "mixtral": (transformers.MixtralForCausalLM, _mixtral, "block_sparse_moe.experts.0.w1.weight"),
    "deepseek_v3": (
        transformers.DeepseekV3ForCausalLM,
        _deepseek_v3,
        "mlp.experts.0.up_proj.weight",
    ),
    "deepseek_v2": (
        transformers.DeepseekV2ForCausalLM,
        _deepseek_v2,
        "mlp.experts.7.down_proj.weight",
    ),
}


def _saved_tensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


@pytest.mark.parametrize("family", list(CAUSAL_LMS))
def test_save_pretrained_layout_converts_to_our_names(family: str, tmp_path: Path) -> None:
    model_cls, make_config, per_expert_name = CAUSAL_LMS[family]
    config = make_config()
    config.num_hidden_layers = 2
    model = model_cls(config)
    _randomize(model, seed=11)
    model.save_pretrained(tmp_path)
    on_disk = list(_saved_tensors(tmp_path))
    names_on_disk = {name for name, _ in on_disk}
    # transformers 5.25 writes the Hub's per-expert layout, not its in-memory fused one.
    assert f"model.layers.1.{per_expert_name}" in names_on_disk
    assert not any(name.endswith("gate_up_proj") for name in names_on_disk)
    moe = moe_config_from_hf(config.to_dict(), model_cls.__name__)
    assert moe is not None
    converted = dict(convert_checkpoint_tensors(on_disk, moe))
    expected = model.state_dict()
    assert converted.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name


def _per_expert_layer(layer: int, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    prefix = f"model.layers.{layer}.mlp"
    tensors = [(f"{prefix}.gate.weight", torch.randn(EXPERTS, HIDDEN, generator=gen))]
    for e in range(EXPERTS):
        for proj, shape in (
            ("gate_proj", (4, HIDDEN)),
            ("up_proj", (4, HIDDEN)),
            ("down_proj", (HIDDEN, 4)),
        ):
            tensors.append(
                (f"{prefix}.experts.{e}.{proj}.weight", torch.randn(shape, generator=gen))
            )
    return tensors


def _deepseek_moe() -> MoEConfig:
    moe = moe_config_from_hf(_hub_deepseek_v3(), "DeepseekV3ForCausalLM")
    assert moe is not None
    return moe


def test_conversion_streams_one_layer_at_a_time() -> None:
    gen = torch.Generator().manual_seed(0)
    layers = [_per_expert_layer(layer, gen) for layer in range(3, 6)]
    consumed: list[str] = []

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for layer in layers:
            for name, tensor in layer:
                consumed.append(name)
                yield name, tensor

    for name, _ in convert_checkpoint_tensors(stream(), _deepseek_moe()):
        if name.endswith(("gate_up_proj", "down_proj")):
            layer = name.split(".")[2]
            # yielded as soon as complete: nothing of a later layer has been read yet
            assert consumed[-1].split(".")[2] == layer, (name, consumed[-1])


def test_conversion_is_order_independent_and_stacks_gate_then_up() -> None:
    gen = torch.Generator().manual_seed(1)
    tensors = _per_expert_layer(3, gen) + _per_expert_layer(4, gen)
    by_name = dict(tensors)
    shuffled = tensors[:]
    random.Random(0).shuffle(shuffled)  # shards may split a layer and come in any order
    converted = dict(convert_checkpoint_tensors(shuffled, _deepseek_moe()))
    assert sorted(converted) == sorted(
        [
            f"model.layers.{i}.mlp.{n}"
            for i in (3, 4)
            for n in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
        ]
    )
    gate_up = converted["model.layers.4.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (EXPERTS, 8, HIDDEN)
    for e in range(EXPERTS):
        expert = f"model.layers.4.mlp.experts.{e}"
        assert torch.equal(gate_up[e, :4], by_name[f"{expert}.gate_proj.weight"])
        assert torch.equal(gate_up[e, 4:], by_name[f"{expert}.up_proj.weight"])
        down = converted["model.layers.4.mlp.experts.down_proj"][e]
        assert torch.equal(down, by_name[f"{expert}.down_proj.weight"])


def _broken(
    change: Callable[[list[tuple[str, torch.Tensor]]], None],
) -> list[tuple[str, torch.Tensor]]:
    tensors = _per_expert_layer(3, torch.Generator().manual_seed(2))
    change(tensors)
    return tensors


@pytest.mark.parametrize(
    ("tensors", "named"),
    [
        (_broken(lambda t: t.pop()), "layers.3.mlp.experts.down_proj"),
        (_broken(lambda t: t.insert(2, t[1])), "duplicate"),
        (
            _broken(
                lambda t: t.append(
                    ("model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv", torch.ones(1))
                )
            ),
            "quantised",
        ),
        (_broken(lambda t: t.__setitem__(1, (t[1][0], torch.zeros(5, HIDDEN)))), "does not match"),
        (
            _broken(
                lambda t: t.append(
                    ("model.layers.3.mlp.experts.8.up_proj.weight", torch.zeros(4, HIDDEN))
                )
            ),
            "expert 8",
        ),
    ],
)
def test_conversion_refuses_broken_checkpoints(
    tensors: list[tuple[str, torch.Tensor]], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        list(convert_checkpoint_tensors(tensors, _deepseek_moe()))
