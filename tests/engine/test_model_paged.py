"""Paged, chunked, prefix-cached and batched forwards equal one full forward (tiny preset)."""

from __future__ import annotations

import pytest
import torch

from pdcache.engine.forward import ForwardBatch, ForwardMode
from pdcache.engine.loader import allocate_device_kv, load_model
from pdcache.engine.presets import PRESETS

PAGE = 16
NUM_PAGES = 64
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny", seed=0)
    return model, tokenizer


def shuffled_pages(seed: int) -> torch.Tensor:
    return torch.randperm(NUM_PAGES, generator=torch.Generator().manual_seed(seed))


def make_batch(
    seqs: list[tuple[list[int], int, torch.Tensor]], mode: ForwardMode, all_rows: bool = False
) -> ForwardBatch:
    """`seqs`: (new token ids, prefix_len, page ids) per sequence."""
    ids, positions, slots = [], [], []
    for new_ids, prefix_len, pages in seqs:
        pos = torch.arange(prefix_len, prefix_len + len(new_ids))
        ids.append(torch.tensor(new_ids))
        positions.append(pos)
        slots.append(pages[pos // PAGE] * PAGE + pos % PAGE)
    width = max(len(p) for _, _, p in seqs)
    table = torch.stack([torch.nn.functional.pad(p, (0, width - len(p))) for _, _, p in seqs])
    total = sum(len(s[0]) for s in seqs)
    return ForwardBatch(
        mode=mode,
        input_ids=torch.cat(ids),
        positions=torch.cat(positions),
        out_slots=torch.cat(slots),
        page_table=table,
        prefix_lens=[s[1] for s in seqs],
        extend_lens=[len(s[0]) for s in seqs],
        logits_indices=torch.arange(total) if all_rows else None,
    )


def forward(model, kv, seqs, mode=ForwardMode.EXTEND, all_rows=False) -> torch.Tensor:
    with torch.inference_mode():
        return model(make_batch(seqs, mode, all_rows), kv)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    """Every row's logits of one fresh full forward (its own pool, contiguous pages)."""
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    return forward(model, kv, [(ids, 0, torch.arange(NUM_PAGES))], all_rows=True)


def prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_chunked_prefill_mid_page_equals_full(tiny) -> None:
    model, tok = tiny
    ids = prompt(tok, "Chunk boundaries fall in the middle of pages " * 3)
    expected = full_logits(model, ids)
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    pages = shuffled_pages(1)
    cuts = [0, 5, 21, 40, 77, len(ids)]  # 5, 21, 77: mid-page; non-contiguous page ids
    got = [
        forward(model, kv, [(ids[a:b], a, pages)], all_rows=True) for a, b in zip(cuts, cuts[1:])
    ]
    assert_same(torch.cat(got), expected)


def test_cached_prefix_ending_mid_page_equals_full(tiny) -> None:
    model, tok = tiny
    ids = prompt(tok, "A cached prefix that ends in the middle of a page.")
    cached_len = 2 * PAGE + 7
    expected = full_logits(model, ids)
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    pages = shuffled_pages(2)
    forward(model, kv, [(ids[:cached_len], 0, pages)])  # an earlier request filled the pool
    got = forward(model, kv, [(ids[cached_len:], cached_len, pages)], all_rows=True)
    assert_same(got, expected[cached_len:])


def test_batched_extend_with_and_without_prefix_equals_full(tiny) -> None:
    model, tok = tiny
    texts = ["first sequence", "the second one is a little longer", "3"]
    seqs = [prompt(tok, t) for t in texts]
    prefix_lens = [0, 19, 9]
    pages = shuffled_pages(3)
    page_sets = [pages[0:8], pages[8:16], pages[16:24]]
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    for ids, n, p in zip(seqs, prefix_lens, page_sets):
        if n:
            forward(model, kv, [(ids[:n], 0, p)])
    batch = [(ids[n:], n, p) for ids, n, p in zip(seqs, prefix_lens, page_sets)]
    got = forward(model, kv, batch)
    expected = torch.stack([full_logits(model, ids)[-1] for ids in seqs])
    assert_same(got, expected)


def test_batched_fresh_prefill_equals_single(tiny) -> None:
    model, tok = tiny
    seqs = [prompt(tok, t) for t in ["alpha", "beta gamma delta", "epsilon zeta"]]
    pages = shuffled_pages(4)
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    batch = [(ids, 0, pages[8 * i : 8 * i + 8]) for i, ids in enumerate(seqs)]
    got = forward(model, kv, batch, all_rows=True)
    expected = torch.cat([full_logits(model, ids) for ids in seqs])
    assert_same(got, expected)


def test_batched_greedy_decode_equals_recompute(tiny) -> None:
    model, tok = tiny
    seqs = [prompt(tok, t) for t in ["short", "a medium length prompt here", "x" * 40]]
    pages = shuffled_pages(5)
    page_sets = [pages[12 * i : 12 * i + 12] for i in range(3)]
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    logits = torch.cat([forward(model, kv, [(s, 0, p)]) for s, p in zip(seqs, page_sets)])
    decoded: list[list[torch.Tensor]] = [[] for _ in seqs]
    for _ in range(24):
        nxt = logits.argmax(-1).tolist()
        for b, tok_id in enumerate(nxt):
            decoded[b].append(logits[b])
            seqs[b].append(tok_id)
        step = [([s[-1]], len(s) - 1, p) for s, p in zip(seqs, page_sets)]
        logits = forward(model, kv, step, mode=ForwardMode.DECODE)
    for b, ids in enumerate(seqs):
        recomputed = full_logits(model, ids[:-1])[-24:]
        assert_same(torch.stack(decoded[b]), recomputed)
    assert len({tuple(s[-24:]) for s in seqs}) == 3  # continuations depend on the prompt


def test_wait_layer_runs_before_each_layer_reads_kv(tiny) -> None:
    model, tok = tiny
    ids = prompt(tok, "per-layer load of the cached prefix")
    cached_len = 2 * PAGE
    pages = shuffled_pages(6)
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    forward(model, kv, [(ids[:cached_len], 0, pages)])
    backup = kv[:, :, pages[:2]].clone()
    kv[:, :, pages[:2]] = 0.0  # the prefix is "on the host": each layer loads it on demand
    calls: list[int] = []

    def wait_layer(layer: int) -> None:
        calls.append(layer)
        kv[layer, :, pages[:2]] = backup[layer]

    batch = make_batch([(ids[cached_len:], cached_len, pages)], ForwardMode.EXTEND)
    batch.wait_layer = wait_layer
    with torch.inference_mode():
        got = model(batch, kv)
    assert calls == list(range(model.config.num_hidden_layers))
    assert_same(got, full_logits(model, ids)[-1:])


def test_forward_stores_kv_in_the_given_slots_only(tiny) -> None:
    model, tok = tiny
    ids = prompt(tok, "slots")
    pages = torch.tensor([9, 3])
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    forward(model, kv, [(ids, 0, pages)])
    used = kv.abs().flatten(3).sum(-1) > 0  # [L, 2, P]: pages holding any nonzero K/V
    assert used[:, :, [9, 3]].all()
    assert used.sum() == model.config.num_hidden_layers * 2 * 2
    slot_filled = kv[0, 0, 3].abs().sum(-1).sum(-1) > 0  # second page: tokens 16..len-1
    assert slot_filled.sum().item() == len(ids) - PAGE


def test_presets_are_deterministic_and_sized() -> None:
    a, _ = load_model("tiny", seed=0)
    b, _ = load_model("tiny", seed=0)
    c, _ = load_model("tiny", seed=1)
    wa, wb, wc = (m.model.layers[0].self_attn.q_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.config.name == b.config.name != c.config.name  # KV of other weights never mixes
    assert PRESETS["small"].max_position_embeddings >= 32768
    small_cfg = PRESETS["small"]
    assert small_cfg.num_key_value_heads < small_cfg.num_attention_heads  # GQA


def test_greedy_margin_far_above_fp32_noise(tiny) -> None:
    """Top-1 vs top-2 margins stay far above chunked-vs-full differences, so greedy is stable."""
    model, tok = tiny
    ids = prompt(tok, "margins") + list(range(40, 200))
    full = full_logits(model, ids)
    kv = allocate_device_kv(model.config, NUM_PAGES, PAGE)
    pages = shuffled_pages(7)
    chunks = [forward(model, kv, [(ids[a : a + 23], a, pages)], all_rows=True) for a in
              range(0, len(ids), 23)]
    noise = (torch.cat(chunks) - full).abs().max().item()
    top2 = full.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert noise < 1e-4
    assert margin > 20 * noise
    assert full.std(dim=-1).mean() > 1.0  # logits are spread, not near-uniform
