"""Sparse mixture-of-experts feed-forward blocks: Qwen3-MoE, Mixtral, DeepSeek-V2/V3 (Kimi K2),
gpt-oss, Qwen3-Next.

Each decoder layer's `mlp` is either a dense SwiGLU (`DenseMLP`) or a `SparseMoeBlock`, built
by `make_mlp`. Parameter names equal those of transformers 5.25's own modules in memory, so
`our_block.load_state_dict(hf_block.state_dict())` works:

- Qwen3-MoE, Mixtral: `gate.weight [E, H]`, `experts.gate_up_proj [E, 2I, H]` (each expert's
  gate rows, then its up rows), `experts.down_proj [E, H, I]`.
- DeepSeek-V3 / Kimi K2: the same plus `gate.e_score_correction_bias [E]` and
  `shared_experts.{gate,up,down}_proj.weight` (one SwiGLU of width I * n_shared_experts).
- DeepSeek-V2: as V3 without `e_score_correction_bias`.
- gpt-oss (`GptOssMoeBlock`): `router.{weight [E, H], bias [E]}`, `experts.gate_up_proj
  [E, H, 2I]` (transposed: x @ W; gate and up columns interleaved, gate first) with
  `experts.gate_up_proj_bias [E, 2I]`, `experts.down_proj [E, I, H]` with
  `experts.down_proj_bias [E, H]`; its checkpoints store exactly these names (bf16 / fp32 ones:
  MXFP4's `*_blocks` / `*_scales` are refused with the quantisation config).
- Qwen3-Next (`Qwen3NextMoeBlock`): Qwen3-MoE's `gate` and `experts` plus
  `shared_expert.{gate,up,down}_proj.weight` (one SwiGLU of `shared_expert_intermediate_size`)
  and `shared_expert_gate.weight [1, H]`: the shared expert's output is scaled per token by
  `sigmoid(shared_expert_gate(x))` before it joins the routed experts'.
- Dense layers: `{gate,up,down}_proj.weight`.

Checkpoints on disk (the Hub's, and what transformers 5.25's `save_pretrained` writes: it
converts back on save) store one tensor per expert and projection instead:

- Qwen3-MoE, Qwen3-Next, DeepSeek-V2/V3, Kimi K2:
  `model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`.
- Mixtral: `model.layers.N.block_sparse_moe.experts.E.{w1,w3,w2}.weight` (gate, up, down) and
  `model.layers.N.block_sparse_moe.gate.weight`.

`convert_checkpoint_tensors` turns such a stream into our names, fusing one layer at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

Family = Literal["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "gpt_oss", "qwen3_next"]
Scoring = Literal["softmax", "sigmoid"]
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
ForwardPath = Literal["fast", "reference"]

FAMILY_BY_ARCHITECTURE: dict[str, Family] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # also Kimi K2 (model_type kimi_k2)
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# config.json keys whose positive value marks an architecture as mixture-of-experts.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# What transformers 5.25 runs for each DeepSeek generation (others are refused, not guessed).
_DEEPSEEK_SCORING: dict[Family, Scoring] = {"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}
_DEEPSEEK_TOPK_METHODS: dict[Family, tuple[TopkMethod, ...]] = {
    "deepseek_v2": ("greedy", "group_limited_greedy"),
    "deepseek_v3": ("noaux_tc",),
}


@dataclass(frozen=True)
class MoEConfig:
    """Everything a model's feed-forward blocks need: routing, expert shapes, which layers
    are sparse (`sparse_layer_ids`, of `num_layers`) and the dense layers' width."""

    family: Family
    scoring: Scoring
    topk_method: TopkMethod
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    norm_topk_prob: bool
    num_layers: int
    sparse_layer_ids: frozenset[int]
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 0
    # gpt-oss's clamped SwiGLU: gate clamped above at `swiglu_limit`, up to +-`swiglu_limit`,
    # out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Qwen3-Next: the width of the one sigmoid-gated shared expert (0: none)
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must lie in [1, num_experts={self.num_experts}]")
        if self.num_experts % self.n_group:
            raise ValueError(
                f"num_experts {self.num_experts} not divisible by n_group {self.n_group}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"topk_group {self.topk_group} must lie in [1, n_group={self.n_group}]"
            )
        if self.topk_method == "noaux_tc" and self.experts_per_group < 2:
            # group scores are the sum of each group's two best experts
            raise ValueError(f"noaux_tc needs >= 2 experts per group, got {self.experts_per_group}")
        bad_layers = sorted(i for i in self.sparse_layer_ids if not 0 <= i < self.num_layers)
        if bad_layers:
            raise ValueError(f"sparse layer ids {bad_layers} outside [0, {self.num_layers})")

    def is_sparse(self, layer_id: int) -> bool:
        """Whether decoder layer `layer_id` has a sparse MoE block (else a dense SwiGLU)."""
        if not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer {layer_id} outside [0, {self.num_layers})")
        return layer_id in self.sparse_layer_ids

    @property
    def router_in_fp32(self) -> bool:
        """transformers computes DeepSeek router logits in fp32 and keeps `gate.*` in fp32
        (`_keep_in_fp32_modules_strict`); Qwen3-MoE and Mixtral route in the model dtype."""
        return self.family in ("deepseek_v2", "deepseek_v3")

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group


# ---------------------------------------------------------------------------------------------
# config.json -> MoEConfig


def moe_config_from_hf(hf: dict[str, Any], architecture: str) -> MoEConfig | None:
    """The MoE settings of a Hugging Face config.json dict; None for a dense architecture.

    Raises ValueError naming any feature these blocks do not run (an unknown `scoring_func`
    or `topk_method`, a non-silu `hidden_act`, expert biases, an unsupported MoE architecture).
    """
    family = FAMILY_BY_ARCHITECTURE.get(architecture)
    if family is None:
        if any(_positive(hf.get(key)) for key in _EXPERT_COUNT_KEYS):
            raise ValueError(
                f"{architecture} is a mixture-of-experts architecture these blocks do not run "
                f"(supported: {', '.join(FAMILY_BY_ARCHITECTURE)})"
            )
        return None
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{architecture}: hidden_act {act!r} is not supported (only silu)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{architecture}: mlp_bias=true is not supported")
    if family == "qwen3_moe":
        return _qwen3_moe_config(hf)
    if family == "qwen3_next":
        return _qwen3_next_config(hf)
    if family == "mixtral":
        return _mixtral_config(hf)
    if family == "gpt_oss":
        return _gpt_oss_config(hf)
    return _deepseek_config(hf, family)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and value > 0


def _required_int(hf: dict[str, Any], *keys: str) -> int:
    for key in keys:
        if hf.get(key) is not None:
            return int(hf[key])
    raise ValueError(f"config.json lacks {' / '.join(keys)}")


def _qwen3_moe_config(hf: dict[str, Any]) -> MoEConfig | None:
    num_experts = _required_int(hf, "num_experts", "num_local_experts")
    if num_experts == 0:  # transformers builds every layer dense then
        return None
    num_layers = _required_int(hf, "num_hidden_layers")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense_only = set(hf.get("mlp_only_layers") or [])
    # Qwen3MoeDecoderLayer: sparse when not listed in mlp_only_layers and (i + 1) % step == 0.
    sparse = frozenset(i for i in range(num_layers) if i not in dense_only and (i + 1) % step == 0)
    return MoEConfig(
        family="qwen3_moe",
        scoring="softmax",
        topk_method="greedy",
        num_experts=num_experts,
        top_k=_required_int(hf, "num_experts_per_tok"),
        moe_intermediate_size=_required_int(hf, "moe_intermediate_size"),
        dense_intermediate_size=_required_int(hf, "intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        num_layers=num_layers,
        sparse_layer_ids=sparse,
    )


def _qwen3_next_config(hf: dict[str, Any]) -> MoEConfig | None:
    # Qwen3NextDecoderLayer picks sparse layers as Qwen3-MoE does; every sparse block adds
    # one shared expert behind a sigmoid gate.
    qwen3 = _qwen3_moe_config(hf)
    if qwen3 is None:
        return None
    return replace(qwen3, family="qwen3_next", shared_expert_intermediate_size=_required_int(
        hf, "shared_expert_intermediate_size"))


def _mixtral_config(hf: dict[str, Any]) -> MoEConfig:
    num_layers = _required_int(hf, "num_hidden_layers")
    width = _required_int(hf, "intermediate_size")  # Mixtral's experts use intermediate_size
    return MoEConfig(
        family="mixtral",
        scoring="softmax",
        topk_method="greedy",
        num_experts=_required_int(hf, "num_local_experts", "num_experts"),
        top_k=_required_int(hf, "num_experts_per_tok"),
        moe_intermediate_size=width,
        dense_intermediate_size=width,
        norm_topk_prob=True,  # MixtralTopKRouter always renormalises the top-k probabilities
        num_layers=num_layers,
        sparse_layer_ids=frozenset(range(num_layers)),
    )


def _gpt_oss_config(hf: dict[str, Any]) -> MoEConfig:
    # Every layer sparse; the router's softmax runs over the top-k logits only (the same
    # weights as renormalised top-k probabilities: norm_topk_prob).
    num_layers = _required_int(hf, "num_hidden_layers")
    width = _required_int(hf, "intermediate_size")
    return MoEConfig(
        family="gpt_oss",
        scoring="softmax",
        topk_method="greedy",
        num_experts=_required_int(hf, "num_local_experts", "num_experts"),
        top_k=_required_int(hf, "num_experts_per_tok"),
        moe_intermediate_size=width,
        dense_intermediate_size=width,
        norm_topk_prob=True,
        num_layers=num_layers,
        sparse_layer_ids=frozenset(range(num_layers)),
        swiglu_alpha=float(hf.get("swiglu_alpha") or 1.702),
        swiglu_limit=float(hf.get("swiglu_limit") or 7.0),
    )


def _deepseek_config(hf: dict[str, Any], family: Family) -> MoEConfig:
    scoring = hf.get("scoring_func") or _DEEPSEEK_SCORING[family]
    if scoring != _DEEPSEEK_SCORING[family]:
        raise ValueError(
            f"{family}: scoring_func {scoring!r} is not supported "
            f"(transformers runs {_DEEPSEEK_SCORING[family]!r})"
        )
    topk_method = hf.get("topk_method") or _DEEPSEEK_TOPK_METHODS[family][0]
    if topk_method not in _DEEPSEEK_TOPK_METHODS[family]:
        raise ValueError(
            f"{family}: topk_method {topk_method!r} is not supported "
            f"(supported: {', '.join(_DEEPSEEK_TOPK_METHODS[family])})"
        )
    norm_topk_prob = bool(hf.get("norm_topk_prob", family == "deepseek_v3"))
    if family == "deepseek_v2" and norm_topk_prob:
        # transformers' DeepseekV2 ignores the flag, DeepSeek's own code renormalises instead
        # of scaling: the two disagree, and no released V2 checkpoint sets it.
        raise ValueError("deepseek_v2: norm_topk_prob=true is not supported")
    grouped = topk_method != "greedy"
    n_group = _required_int(hf, "n_group") if grouped else 1
    topk_group = _required_int(hf, "topk_group") if grouped else 1
    num_layers = _required_int(hf, "num_hidden_layers")
    return MoEConfig(
        family=family,
        scoring=scoring,
        topk_method=topk_method,
        num_experts=_required_int(hf, "n_routed_experts", "num_local_experts", "num_experts"),
        top_k=_required_int(hf, "num_experts_per_tok"),
        moe_intermediate_size=_required_int(hf, "moe_intermediate_size"),
        dense_intermediate_size=_required_int(hf, "intermediate_size"),
        norm_topk_prob=norm_topk_prob,
        num_layers=num_layers,
        sparse_layer_ids=_deepseek_sparse_layers(hf, num_layers),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
        n_group=n_group,
        topk_group=topk_group,
        n_shared_experts=int(hf.get("n_shared_experts") or 0),
    )


def _deepseek_sparse_layers(hf: dict[str, Any], num_layers: int) -> frozenset[int]:
    # DeepSeek's reference code: sparse from first_k_dense_replace on, every moe_layer_freq-th
    # layer. transformers 5.25 ignores moe_layer_freq; every released checkpoint has it at 1,
    # where the two agree.
    first_sparse = int(hf.get("first_k_dense_replace") or 0)
    freq = int(hf.get("moe_layer_freq") or 1)
    return frozenset(i for i in range(first_sparse, num_layers) if i % freq == 0)


# ---------------------------------------------------------------------------------------------
# Modules


class DenseMLP(nn.Module):
    """SwiGLU feed-forward with Hugging Face names (same as `pdcache.engine.model.MLP`)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """Owns the router projection `weight [E, H]` (and DeepSeek-V3's `e_score_correction_bias
    [E]`); maps tokens `[T, H]` to their expert ids `[T, K]` and combine weights `[T, K]`."""

    def __init__(self, moe: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.moe = moe
        weight_dtype = torch.float32 if moe.router_in_fp32 else None
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size, dtype=weight_dtype))
        if moe.topk_method == "noaux_tc":
            # A buffer in transformers; a frozen parameter here so loaders that walk
            # named_parameters() fill it too. The state_dict name is the same.
            bias = torch.zeros(moe.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.moe.topk_method == "noaux_tc":
            return self._route_noaux_tc(x)
        if self.moe.router_in_fp32:
            return self._route_deepseek_v2(x)
        return self._route_softmax(x)

    def _route_softmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Qwen3-MoE / Mixtral: logits in the model dtype, probabilities in fp32.
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.moe.family in ("qwen3_moe", "qwen3_next"):  # cast back; Mixtral keeps fp32
            weights = weights.to(logits.dtype)
        return expert_ids, weights

    def _route_deepseek_v2(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        if self.moe.topk_method == "group_limited_greedy":
            group_scores = scores.view(-1, self.moe.n_group, self.moe.experts_per_group)
            allowed = self._group_mask(group_scores.max(dim=-1).values)
            scores = scores.masked_fill(~allowed, 0.0)  # 0, not -inf: as transformers does
        weights, expert_ids = torch.topk(scores, k=self.moe.top_k, dim=-1, sorted=False)
        return expert_ids, weights * self.moe.routed_scaling_factor

    def _route_noaux_tc(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        # The bias only steers which experts are chosen; the weights come from `scores`.
        biased = scores + self.e_score_correction_bias.float()
        per_group = biased.view(-1, self.moe.n_group, self.moe.experts_per_group)
        allowed = self._group_mask(per_group.topk(2, dim=-1)[0].sum(dim=-1))
        biased = biased.masked_fill(~allowed, float("-inf"))
        expert_ids = torch.topk(biased, k=self.moe.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, expert_ids)
        if self.moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.moe.routed_scaling_factor

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """Bool `[T, E]`: the experts in each token's `topk_group` best groups."""
        best_groups = torch.topk(group_scores, k=self.moe.topk_group, dim=-1, sorted=False)[1]
        chosen = torch.zeros_like(group_scores, dtype=torch.bool)
        chosen.scatter_(1, best_groups, True)
        return chosen.repeat_interleave(self.moe.experts_per_group, dim=1)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> TopKRouter:
        # `.to(bfloat16)` must not round a DeepSeek router: transformers keeps it in fp32.
        if not self.moe.router_in_fp32:
            return super()._apply(fn, recurse)
        originals = {name: p.data for name, p in self.named_parameters(recurse=False)}
        super()._apply(fn, recurse)
        for name, original in originals.items():
            current = getattr(self, name)
            if current.dtype != torch.float32:
                current.data = original.to(device=current.device, dtype=torch.float32)
        return self


class RoutedExperts(nn.Module):
    """Owns every routed expert's SwiGLU weights, fused as transformers 5.25 holds them:
    `gate_up_proj [E, 2I, H]` (gate rows, then up rows) and `down_proj [E, H, I]`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(
            torch.zeros(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden_size, intermediate_size))

    def expert(self, expert_id: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert_id`'s SwiGLU on tokens `x [n, H]`."""
        gate, up = F.linear(x, self.gate_up_proj[expert_id]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[expert_id])

    def forward_fast(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Tokens grouped by expert: per active expert one gather, two matmuls, one scatter-add
        (experts in ascending order and each product cast before adding, as transformers does)."""
        out = torch.zeros_like(x)
        top_k = expert_ids.shape[1]
        slot_order = torch.argsort(expert_ids.reshape(-1), stable=True)
        token_of_slot = slot_order // top_k
        weight_of_slot = weights.reshape(-1)[slot_order]
        counts = torch.bincount(expert_ids.reshape(-1), minlength=self.num_experts).tolist()
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            token_idx = token_of_slot[start : start + count]
            y = self.expert(expert_id, x.index_select(0, token_idx))
            y = y * weight_of_slot[start : start + count, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
            start += count
        return out

    def forward_reference(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One token and one chosen expert at a time: slow and obviously right."""
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(expert_ids.shape[1]):
                y = self.expert(int(expert_ids[t, k]), x[t : t + 1])
                # A [1, 1] weight (not 0-d) so dtype promotion matches the fast path.
                out[t] += (y * weights[t : t + 1, k : k + 1])[0].to(out.dtype)
        return out


class SparseMoeBlock(nn.Module):
    """Owns one sparse layer's router (`gate`), routed experts (`experts`) and, for DeepSeek,
    the always-on `shared_experts`. `path` picks the experts' forward: "fast" or "reference"."""

    def __init__(self, moe: MoEConfig, hidden_size: int, path: ForwardPath = "fast") -> None:
        super().__init__()
        self.path: ForwardPath = path
        self.gate = TopKRouter(moe, hidden_size)
        self.experts = RoutedExperts(moe.num_experts, hidden_size, moe.moe_intermediate_size)
        self.shared_experts: DenseMLP | None = None
        if moe.n_shared_experts > 0:
            shared_width = moe.moe_intermediate_size * moe.n_shared_experts
            self.shared_experts = DenseMLP(hidden_size, shared_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens `[..., H]` (usually `[T, H]`) in, the same shape out."""
        tokens = x.reshape(-1, x.shape[-1])
        expert_ids, weights = self.gate(tokens)
        if self.path == "fast":
            out = self.experts.forward_fast(tokens, expert_ids, weights)
        elif self.path == "reference":
            out = self.experts.forward_reference(tokens, expert_ids, weights)
        else:
            raise ValueError(f"unknown MoE forward path {self.path!r} (fast, reference)")
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(x.shape)


class GptOssRouter(nn.Module):
    """gpt-oss's router: owns `weight [E, H]` and `bias [E]`; the softmax runs over the top-k
    logits, in the model dtype (as transformers' `GptOssTopKRouter`)."""

    def __init__(self, moe: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        top_logits, expert_ids = torch.topk(logits, self.top_k, dim=-1)
        return expert_ids, torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)


class GptOssExperts(RoutedExperts):
    """gpt-oss's experts, as transformers holds them: `gate_up_proj [E, H, 2I]` (x @ W, gate
    and up columns interleaved) + `gate_up_proj_bias [E, 2I]`, `down_proj [E, I, H]` +
    `down_proj_bias [E, H]`, and the clamped SwiGLU between. Routing and combining: the
    parent's fast and reference paths."""

    def __init__(self, moe: MoEConfig, hidden_size: int) -> None:
        nn.Module.__init__(self)
        self.num_experts = experts = moe.num_experts
        width = moe.moe_intermediate_size
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden_size, 2 * width))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(experts, 2 * width))
        self.down_proj = nn.Parameter(torch.zeros(experts, width, hidden_size))
        self.down_proj_bias = nn.Parameter(torch.zeros(experts, hidden_size))

    def expert(self, expert_id: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj[expert_id] + self.gate_up_proj_bias[expert_id]
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        gated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return gated @ self.down_proj[expert_id] + self.down_proj_bias[expert_id]


class GptOssMoeBlock(nn.Module):
    """Owns one gpt-oss layer's `router` and `experts` (transformers' `GptOssMLP` names).
    `path` picks the experts' forward: "fast" or "reference"."""

    def __init__(self, moe: MoEConfig, hidden_size: int, path: ForwardPath = "fast") -> None:
        super().__init__()
        self.path: ForwardPath = path
        self.router = GptOssRouter(moe, hidden_size)
        self.experts = GptOssExperts(moe, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens `[..., H]` in, the same shape out."""
        tokens = x.reshape(-1, x.shape[-1])
        expert_ids, weights = self.router(tokens)
        if self.path == "fast":
            out = self.experts.forward_fast(tokens, expert_ids, weights)
        elif self.path == "reference":
            out = self.experts.forward_reference(tokens, expert_ids, weights)
        else:
            raise ValueError(f"unknown MoE forward path {self.path!r} (fast, reference)")
        return out.view(x.shape)


class Qwen3NextMoeBlock(SparseMoeBlock):
    """Owns one Qwen3-Next sparse layer: the parent's router (`gate`) and routed `experts`,
    plus `shared_expert` (a SwiGLU) and `shared_expert_gate [1, H]`, its per-token sigmoid
    gate (transformers' `Qwen3NextSparseMoeBlock` names)."""

    def __init__(self, moe: MoEConfig, hidden_size: int, path: ForwardPath = "fast") -> None:
        super().__init__(moe, hidden_size, path)
        self.shared_expert = DenseMLP(hidden_size, moe.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens `[..., H]` in, the same shape out."""
        tokens = x.reshape(-1, x.shape[-1])
        routed = super().forward(tokens)
        shared = torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return (routed + shared).view(x.shape)


def make_mlp(
    moe: MoEConfig | None, hidden_size: int, intermediate_size: int, layer_id: int
) -> nn.Module:
    """Layer `layer_id`'s feed-forward: a `SparseMoeBlock` (gpt-oss: `GptOssMoeBlock`,
    Qwen3-Next: `Qwen3NextMoeBlock`) where
    `moe` says the layer is sparse, else a `DenseMLP` of `intermediate_size` (config.json's
    `intermediate_size`)."""
    if moe is None or not moe.is_sparse(layer_id):
        if moe is not None and moe.dense_intermediate_size != intermediate_size:
            raise ValueError(
                f"dense layer width {intermediate_size} != the MoE config's "
                f"{moe.dense_intermediate_size}"
            )
        return DenseMLP(hidden_size, intermediate_size)
    if moe.family == "gpt_oss":
        return GptOssMoeBlock(moe, hidden_size)
    if moe.family == "qwen3_next":
        return Qwen3NextMoeBlock(moe, hidden_size)
    return SparseMoeBlock(moe, hidden_size)


def set_moe_path(model: nn.Module, path: ForwardPath) -> None:
    """Switch every `SparseMoeBlock` in `model` to the "fast" or "reference" experts path."""
    for module in model.modules():
        if isinstance(module, (SparseMoeBlock, GptOssMoeBlock)):
            module.path = path


# ---------------------------------------------------------------------------------------------
# Checkpoint names


# `<layer>.experts.<E>.<proj>.<suffix>`; the layer part ends in `.mlp` once Mixtral's
# `block_sparse_moe` is renamed.
_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
    r"\.(?P<suffix>[A-Za-z_]+)$"
)
# Row block of `gate_up_proj` each on-disk projection fills (None: it is `down_proj`).
_GATE_UP_HALF: dict[str, int | None] = {
    "gate_proj": 0,
    "w1": 0,
    "up_proj": 1,
    "w3": 1,
    "down_proj": None,
    "w2": None,
}


class _FusedTensorBuilder:
    """Owns one fused tensor being filled from per-expert pieces: `gate_up_proj` takes two
    pieces per expert (gate, up), `down_proj` one."""

    def __init__(self, name: str, num_experts: int, pieces_per_expert: int) -> None:
        self.name = name
        self.num_experts = num_experts
        self.pieces_per_expert = pieces_per_expert
        self.tensor: torch.Tensor | None = None
        self.filled: set[tuple[int, int]] = set()

    def add(self, expert_id: int, half: int, piece: torch.Tensor, source: str) -> None:
        if expert_id >= self.num_experts:
            raise ValueError(f"{source}: expert {expert_id} >= num_experts {self.num_experts}")
        if (expert_id, half) in self.filled:
            raise ValueError(f"{source}: duplicate tensor")
        if self.tensor is None:  # sized by the first piece; every later one must match it
            shape = (self.num_experts, piece.shape[0] * self.pieces_per_expert, *piece.shape[1:])
            self.tensor = torch.empty(shape, dtype=piece.dtype)
        rows = self.tensor.shape[1] // self.pieces_per_expert
        slot = self.tensor[expert_id, half * rows : (half + 1) * rows]
        if piece.shape != slot.shape or piece.dtype != self.tensor.dtype:
            raise ValueError(
                f"{source}: {tuple(piece.shape)} {piece.dtype} does not match the other experts' "
                f"{tuple(slot.shape)} {self.tensor.dtype}"
            )
        slot.copy_(piece)
        self.filled.add((expert_id, half))

    @property
    def complete(self) -> bool:
        return len(self.filled) == self.num_experts * self.pieces_per_expert

    def take(self) -> torch.Tensor:
        if self.tensor is None or not self.complete:
            raise ValueError(f"{self.name}: experts missing")
        return self.tensor


def convert_checkpoint_tensors(
    names_and_tensors: Iterable[tuple[str, torch.Tensor]], moe: MoEConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename and fuse a checkpoint's per-expert tensors into this module's parameter names.

    On disk (see the module docstring) Qwen3-MoE, DeepSeek-V2/V3 and Kimi K2 store
    `...mlp.experts.E.{gate,up,down}_proj.weight`, Mixtral `...block_sparse_moe.experts.E.
    {w1,w3,w2}.weight` and `...block_sparse_moe.gate.weight`. Each layer's `experts.
    gate_up_proj` / `experts.down_proj` is yielded as soon as its last expert arrives, so only
    the layers still incomplete are buffered (one at a time in checkpoint order, two across a
    shard boundary). Other tensors pass through with Mixtral's `block_sparse_moe` renamed to
    `mlp`; already-fused names pass unchanged. ValueError for quantised expert tensors (any
    suffix but `weight`), duplicates, shape/dtype mismatches and layers left incomplete.
    """
    pending: dict[str, _FusedTensorBuilder] = {}
    for name, tensor in names_and_tensors:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT_TENSOR.match(name)
        if match is None:
            yield name, tensor
            continue
        if match["suffix"] != "weight":
            raise ValueError(f"{name}: quantised expert tensors are not supported")
        builder = _builder_for(pending, match, moe.num_experts)
        half = _GATE_UP_HALF[match["proj"]]
        builder.add(int(match["expert"]), half or 0, tensor, name)
        if builder.complete:
            del pending[builder.name]
            yield builder.name, builder.take()
    if pending:
        raise ValueError(f"checkpoint ends with experts missing for: {', '.join(sorted(pending))}")


def _builder_for(
    pending: dict[str, _FusedTensorBuilder], match: re.Match[str], num_experts: int
) -> _FusedTensorBuilder:
    is_down = _GATE_UP_HALF[match["proj"]] is None
    fused_name = f"{match['prefix']}.{'down_proj' if is_down else 'gate_up_proj'}"
    if fused_name not in pending:
        pending[fused_name] = _FusedTensorBuilder(fused_name, num_experts, 1 if is_down else 2)
    return pending[fused_name]


def split_expert_tensors(
    state: dict[str, torch.Tensor],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Our state dict under the on-disk names of Qwen3-MoE and DeepSeek checkpoints: each
    fused `experts.gate_up_proj` / `experts.down_proj` as one tensor per expert and projection
    (`experts.E.{gate,up,down}_proj.weight`), the inverse of `convert_checkpoint_tensors`;
    every other tensor unchanged."""
    for name, tensor in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for expert, rows in enumerate(tensor):
                gate, up = rows.chunk(2, dim=0)
                yield f"{prefix}{expert}.gate_proj.weight", gate
                yield f"{prefix}{expert}.up_proj.weight", up
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for expert, weight in enumerate(tensor):
                yield f"{prefix}{expert}.down_proj.weight", weight
        else:
            yield name, tensor
