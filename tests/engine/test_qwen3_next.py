"""Qwen3-Next (`Qwen3NextForCausalLM`) at the model level equals transformers' forward.

A tiny checkpoint built by transformers (fp32, fixed seed): 4 layers, linear / full attention
alternating (`full_attention_interval` 2), gated DeltaNet with 2 key heads over 4 value heads,
gated attention with partial RoPE, MoE of 4 experts (top 2) with a sigmoid-gated shared expert
and one dense layer. Our model runs over a paged KV pool and a `RecurrentStatePool`, driven
through `ForwardBatch` directly (the engine's runs: tests/engine/test_qwen3_next_engine.py).

Tolerance: logits within atol 2e-4 / rtol 1e-4 of transformers' (|logits| up to ~13). A cold
prompt in one forward is the same computation and lands within ~1e-5; chunked prefill and
decode regroup the delta rule's fp32 sums (chunks of 12 instead of one, the recurrence
instead of the chunked form) and land within ~1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdcache.engine.forward import ForwardBatch, ForwardMode  # noqa: E402
from pdcache.engine.gated_deltanet import GatedDeltaNet  # noqa: E402
from pdcache.engine.kv_geometry import KVGeometry  # noqa: E402
from pdcache.engine.kv_pool import allocate_kv_tensor  # noqa: E402
from pdcache.engine.loader import load_model  # noqa: E402
from pdcache.engine.moe import Qwen3NextMoeBlock, set_moe_path  # noqa: E402
from pdcache.engine.qwen3_next import (  # noqa: E402
    Qwen3NextForCausalLM,
    load_qwen3_next,
    qwen3_next_config_from_hf,
)
from pdcache.engine.state_geometry import LinearAttentionConfig, RecurrentStateGeometry  # noqa: E402
from pdcache.engine.state_pool import (  # noqa: E402
    RecurrentStatePool,
    StateAllocationError,
    StateSnapshot,
)
from tests.engine.test_model_parity import _randomize, write_byte_tokenizer  # noqa: E402

VOCAB = 300
PAGE = 4
NUM_PAGES = 48
ATOL, RTOL = 2e-4, 1e-4
COLD_ATOL = 2e-5
PROMPT = [(i * 37 + 11) % VOCAB for i in range(40)]
OTHER = [(i * 53 + 7) % VOCAB for i in range(27)]

QWEN3_NEXT = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "full_attention_interval": 2, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48, "mlp_only_layers": [1],
    "max_position_embeddings": 512,
}


def save_qwen3_next(path: Path, seed: int = 7) -> torch.nn.Module:
    """A tiny Qwen3-Next checkpoint built by transformers (fp32, random weights from `seed`)
    with the byte tokenizer, saved at `path`; returns the transformers model."""
    config = transformers.Qwen3NextConfig(**QWEN3_NEXT)
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(hf, seed)
    hf.eval()
    hf.save_pretrained(path)
    write_byte_tokenizer(path)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3-next")
    return path, save_qwen3_next(path)


@pytest.fixture(scope="module")
def model(checkpoint) -> Qwen3NextForCausalLM:
    return load_qwen3_next(checkpoint[0])


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


class Sequence:
    """One request's pages and state slot, run through `ForwardBatch` as runner.py builds it."""

    def __init__(self, pages: list[int], pool: RecurrentStatePool, slot: int | None = None,
                 kv_len: int = 0) -> None:
        self.pages = torch.tensor(pages, dtype=torch.long)
        self.pool = pool
        self.slot = pool.alloc() if slot is None else slot
        self.kv_len = kv_len

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        return self.pages[positions // PAGE] * PAGE + positions % PAGE


def run(model: Qwen3NextForCausalLM, kv: torch.Tensor, seqs: list[Sequence],
        chunks: list[list[int]], mode: ForwardMode = ForwardMode.EXTEND) -> torch.Tensor:
    """One forward of `chunks[b]` new tokens for each sequence; all rows' logits."""
    positions = [torch.arange(s.kv_len, s.kv_len + len(c)) for s, c in zip(seqs, chunks)]
    width = max(len(s.pages) for s in seqs)
    table = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        table[row, : len(s.pages)] = s.pages
    total = sum(len(c) for c in chunks)
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.tensor([t for c in chunks for t in c]),
        positions=torch.cat(positions),
        out_slots=torch.cat([s.slots(p) for s, p in zip(seqs, positions)]),
        page_table=table,
        prefix_lens=[s.kv_len for s in seqs],
        extend_lens=[len(c) for c in chunks],
        logits_indices=torch.arange(total),
        state_pool=seqs[0].pool,
        state_slots=[s.slot for s in seqs],
    )
    with torch.inference_mode():
        logits = model(batch, kv)
    for s, c in zip(seqs, chunks):
        s.kv_len += len(c)
    return logits


def fresh(model: Qwen3NextForCausalLM, slots: int = 4) -> tuple[torch.Tensor, RecurrentStatePool]:
    kv = allocate_kv_tensor(model.config, NUM_PAGES, PAGE)
    return kv, RecurrentStatePool(model.config.state_geometry, slots)


def close(got: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    assert expected.abs().max() > 1.0  # logits are not trivially tiny
    torch.testing.assert_close(got, expected, atol=atol, rtol=RTOL)


# ---- config, geometry, bytes -----------------------------------------------------------------

def test_config_layer_kinds_geometry_and_state_bytes(model) -> None:
    config = model.config
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert config.partial_rotary_factor == 0.25
    assert config.moe is not None and config.moe.family == "qwen3_next"
    assert config.moe.sparse_layer_ids == {0, 2, 3}
    assert isinstance(model.model.layers[0].mlp, Qwen3NextMoeBlock)
    geometry = config.kv_geometry
    assert geometry.layer_kinds == ("linear", "full", "linear", "full")
    assert geometry.kv_layers == (1, 3) and geometry.linear_layers == (0, 2)
    assert [geometry.kv_layer_index(i) for i in (1, 3)] == [0, 1]
    # only the two attention layers have KV rows: pages, pools and bytes count them alone
    plain = KVGeometry.mha(2, 2, 16, "float32")
    assert geometry.token_bytes == plain.token_bytes == 2 * 2 * 2 * 16 * 4
    assert geometry.page_bytes(PAGE) == plain.page_bytes(PAGE)
    assert geometry.device_shape(8, PAGE) == (2, 2, 8, PAGE, 2, 16)
    assert "layer_kinds=LFLF" in geometry.fingerprint("m", PAGE)
    assert "2 linear without KV" in geometry.describe()
    with pytest.raises(ValueError, match="layer 0 is a 'linear' layer"):
        geometry.kv_layer_index(0)
    state = config.state_geometry
    assert state is not None and state.layer_ids == (0, 2)
    assert state.conv_shape == (2 * 16 + 32, 3) and state.ssm_shape == (4, 8, 8)
    assert state.state_bytes() == 2 * (64 * 3 * 4 + 4 * 8 * 8 * 4)
    assert state.ssm_dtype == "float32"


def test_geometry_refuses_all_linear_layers_and_unknown_kinds() -> None:
    base = KVGeometry.mha(2, 1, 8, "float32")
    with pytest.raises(ValueError, match="at least one layer with KV"):
        base.with_layer_kinds(("linear", "linear"))
    with pytest.raises(ValueError, match=r"\['recurrent'\] are not run"):
        base.with_layer_kinds(("full", "recurrent"))
    device_kv = torch.zeros(KVGeometry.mha(4, 1, 8, "float32").device_shape(2, PAGE))
    with pytest.raises(ValueError, match="not the model's KV geometry"):
        base.with_layer_kinds(("linear", "full")).check_device_shape(tuple(device_kv.shape))


def test_real_qwen3_next_shapes_give_the_reference_byte_counts() -> None:
    # Qwen3-Next-80B-A3B (transformers' defaults): 36 DeltaNet + 12 attention layers;
    # ../shared/reference/model-families.md: 24,576 B of KV per token, 73.7 MiB of state
    # with an fp32 SSM state and a bf16 conv state.
    hf = transformers.Qwen3NextConfig().to_dict()
    config = qwen3_next_config_from_hf({**hf, "architectures": ["Qwen3NextForCausalLM"]},
                                       dtype="bfloat16")
    assert len(config.linear_layer_ids) == 36 and config.kv_geometry.num_kv_layers == 12
    assert config.kv_bytes_per_token == 24_576
    state = config.state_geometry
    assert state is not None
    assert state.state_bytes() == 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2) == 77_266_944
    assert round(state.state_bytes() / 2**20, 1) == 73.7


def test_the_loader_builds_the_model_and_refuses_unknown_layer_kinds(checkpoint) -> None:
    loaded, _ = load_model(str(checkpoint[0]))
    assert isinstance(loaded, Qwen3NextForCausalLM)
    config = json.loads((checkpoint[0] / "config.json").read_text())
    with pytest.raises(ValueError, match="'mamba'"):
        qwen3_next_config_from_hf({**config, "layer_types": ["mamba"] * 4})


# ---- parity with transformers ----------------------------------------------------------------

@pytest.mark.parametrize("path", ["fast", "reference"])
def test_cold_prompt_in_one_forward(checkpoint, model, path) -> None:
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.path = path
    set_moe_path(model, path)
    try:
        kv, pool = fresh(model)
        got = run(model, kv, [Sequence(list(range(10)), pool)], [PROMPT])
    finally:
        for module in model.modules():
            if isinstance(module, GatedDeltaNet):
                module.path = "fast"
        set_moe_path(model, "fast")
    close(got, hf_logits(checkpoint[1], PROMPT), COLD_ATOL if path == "fast" else ATOL)


def test_prompt_in_chunks_of_12_carries_the_state(checkpoint, model) -> None:
    kv, pool = fresh(model)
    seq = Sequence(list(range(10)), pool)
    got = torch.cat([run(model, kv, [seq], [PROMPT[i:i + 12]]) for i in range(0, 40, 12)])
    close(got, hf_logits(checkpoint[1], PROMPT))


def test_greedy_decode_one_token_at_a_time(checkpoint, model) -> None:
    kv, pool = fresh(model)
    seq = Sequence(list(range(12)), pool)
    logits = run(model, kv, [seq], [PROMPT])[-1:]
    tokens: list[int] = []
    rows = []
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        logits = run(model, kv, [seq], [[tokens[-1]]], ForwardMode.DECODE)
        rows.append(logits)
    expected = hf_logits(checkpoint[1], PROMPT + tokens)
    assert expected[len(PROMPT) - 1:-1].argmax(-1).tolist() == tokens
    close(torch.cat(rows), expected[len(PROMPT):])


def test_two_sequences_batched_in_extend_and_decode(checkpoint, model) -> None:
    kv, pool = fresh(model)
    a, b = Sequence(list(range(0, 12)), pool), Sequence(list(range(12, 24)), pool)
    first = run(model, kv, [a, b], [PROMPT[:24], OTHER[:20]])
    second = run(model, kv, [a, b], [PROMPT[24:36], OTHER[20:]])
    decoded = run(model, kv, [a, b], [[PROMPT[36]], [5]], ForwardMode.DECODE)
    hf = checkpoint[1]
    expected_a, expected_b = hf_logits(hf, PROMPT[:37]), hf_logits(hf, OTHER + [5])
    close(torch.cat([first[:24], second[:12], decoded[:1]]), expected_a)
    close(torch.cat([first[24:], second[12:], decoded[1:]]), expected_b)


def test_restored_state_and_cached_pages_continue_like_a_cold_run(checkpoint, model) -> None:
    kv, pool = fresh(model)
    first = Sequence(list(range(10)), pool)
    run(model, kv, [first], [PROMPT[:12]])
    run(model, kv, [first], [PROMPT[12:24]])
    snapshot = pool.snapshot(first.slot)  # the state at token 24 (a page boundary)
    assert snapshot.nbytes == pool.state_bytes() and snapshot.data.dtype == torch.uint8
    run(model, kv, [first], [PROMPT[24:]])  # the first request moves on; the snapshot stays
    pool.free(first.slot)

    # another pool of the same geometry (as on another node): restore, then reuse the first
    # request's 6 pages of tokens 0..23 (full-attention KV) and prefill the rest
    other = RecurrentStatePool(model.config.state_geometry, 2)
    second = Sequence([*range(6), *range(20, 26)], other, kv_len=24)
    other.restore(second.slot, snapshot)
    got = run(model, kv, [second], [PROMPT[24:]])
    tail = run(model, kv, [second], [[PROMPT[0]]], ForwardMode.DECODE)
    expected = hf_logits(checkpoint[1], PROMPT + [PROMPT[0]])
    close(torch.cat([got, tail]), expected[24:])

    # without the state (the zero state at token 24) the same pages give other logits
    stateless = Sequence([*range(6), *range(30, 36)], other, kv_len=24)
    wrong = run(model, kv, [stateless], [PROMPT[24:]])
    assert (wrong - expected[24:40]).abs().max() > 1e-2


# ---- the state pool --------------------------------------------------------------------------

def _geometry(layers: tuple[int, ...] = (0, 2), conv_dtype: str = "float32"
              ) -> RecurrentStateGeometry:
    return RecurrentStateGeometry(layers, LinearAttentionConfig(4, 8, 8, 2, 4), conv_dtype)


def test_state_slots_are_allocated_and_freed_exactly_once() -> None:
    pool = RecurrentStatePool(_geometry(), 3)
    slots = [pool.alloc() for _ in range(3)]
    assert slots == [0, 1, 2] and pool.alloc() is None and pool.num_used == 3
    pool.ssm[:, 1].fill_(3.0)
    pool.conv[:, 1].fill_(2.0)
    pool.free(1)
    pool.check()
    with pytest.raises(StateAllocationError, match="not held"):
        pool.free(1)
    with pytest.raises(StateAllocationError, match="outside the pool"):
        pool.free(7)
    assert pool.alloc() == 1  # handed out again: zeroed, the state before any token
    assert not pool.ssm[:, 1].any() and not pool.conv[:, 1].any()
    for slot in (0, 1, 2):
        pool.free(slot)
    assert pool.num_free == 3
    pool.check()


def test_snapshot_copy_and_restore_round_trip_the_flat_layout() -> None:
    geometry = _geometry(conv_dtype="bfloat16")
    pool = RecurrentStatePool(geometry, 3)
    a, b, c = pool.alloc(), pool.alloc(), pool.alloc()
    gen = torch.Generator().manual_seed(0)
    pool.conv[:, a] = torch.randn(pool.conv[:, a].shape, generator=gen).to(torch.bfloat16)
    pool.ssm[:, a] = torch.randn(pool.ssm[:, a].shape, generator=gen)
    snap = pool.snapshot(a)
    assert snap.nbytes == geometry.state_bytes() == geometry.conv_bytes + geometry.ssm_bytes
    # the documented layout: conv states of every linear layer, then the fp32 SSM states
    conv = snap.data[:geometry.conv_bytes].view(torch.bfloat16).view(pool.conv[:, a].shape)
    ssm = snap.data[geometry.conv_bytes:].view(torch.float32).view(pool.ssm[:, a].shape)
    assert torch.equal(conv, pool.conv[:, a]) and torch.equal(ssm, pool.ssm[:, a])
    pool.restore(b, snap)
    pool.copy_slot(a, c)
    for slot in (b, c):
        assert torch.equal(pool.conv[:, slot], pool.conv[:, a])
        assert torch.equal(pool.ssm[:, slot], pool.ssm[:, a])
    pool.free(c)
    with pytest.raises(StateAllocationError):
        pool.copy_slot(a, c)
    with pytest.raises(StateAllocationError):
        pool.snapshot(c)


@pytest.mark.parametrize("other", [_geometry(layers=(1, 3)), _geometry(conv_dtype="bfloat16"),
                                   RecurrentStateGeometry((0, 2), LinearAttentionConfig(
                                       4, 8, 8, 1, 4), "float32")])
def test_a_snapshot_of_another_geometry_is_refused(other: RecurrentStateGeometry) -> None:
    pool = RecurrentStatePool(_geometry(), 2)
    slot = pool.alloc()
    assert slot is not None
    source = RecurrentStatePool(other, 1)
    snapshot = source.snapshot(source.alloc())
    pool.ssm[:, slot].fill_(1.0)
    with pytest.raises(ValueError, match="another geometry"):
        pool.restore(slot, snapshot)
    assert bool((pool.ssm[:, slot] == 1.0).all())  # nothing written


def test_a_snapshot_of_the_wrong_length_is_refused() -> None:
    pool = RecurrentStatePool(_geometry(), 2)
    slot = pool.alloc()
    good = pool.snapshot(slot)
    for data in (good.data[:-4], good.data.view(torch.int32)):
        with pytest.raises(ValueError, match="uint8 bytes"):
            pool.restore(slot, StateSnapshot(good.geometry, data))


def test_the_model_refuses_a_state_pool_of_another_geometry(model) -> None:
    kv = allocate_kv_tensor(model.config, NUM_PAGES, PAGE)
    pool = RecurrentStatePool(_geometry(layers=(1, 3)), 1)
    with pytest.raises(ValueError, match="state pool of another geometry"):
        run(model, kv, [Sequence([0, 1], pool)], [PROMPT[:5]])
    with pytest.raises(ValueError, match="needs a state pool"):
        batch = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.tensor([1]),
                             positions=torch.tensor([0]), out_slots=torch.tensor([0]),
                             page_table=torch.zeros((1, 1), dtype=torch.long),
                             prefix_lens=[0], extend_lens=[1])
        model(batch, kv)


def test_checkpoint_config_reads_layer_types_from_the_interval(checkpoint) -> None:
    hf = json.loads((checkpoint[0] / "config.json").read_text())
    del hf["layer_types"]
    hf["full_attention_interval"] = 4
    config = qwen3_next_config_from_hf(hf)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        qwen3_next_config_from_hf({**hf, "rope_parameters": {"rope_type": "yarn"}})
