"""The window tail: what a sliding-window model's sequence carries past the device tier
(docs/design.md §4.14) — the pages whose sliding layers a prompt's or answer's end needs
(`WindowPages.tail_pages`), the copy that moves the full layers of every page and the sliding
layers of the tail only into a split page space (`window_tail_copy_batch`), and the storage
key a window page gets (`window_page_key`, chained to the page key as a state key is).
Over the wire (control protocol 9): a decode registering a window pool gets from a
one-space prefill the full layers of every page and the sliding layers of the tail only.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from pdcache.engine.kv_geometry import KVGeometry
from pdcache.engine.page_keys import (
    chain_page_keys,
    make_salt,
    state_key,
    window_page_key,
    window_page_keys,
)
from pdcache.engine.window_pages import WindowPages
from pdcache.transfer.errors import TransferError
from pdcache.transfer.layout import KVLayout, layer_copy_batch, window_tail_copy_batch
from pdcache.transfer.messages import (
    PrefillReport,
    Register,
    RoomRequest,
    decode,
    encode,
    pack_pages,
    wire_version,
)
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import RoomState
from pdcache.transfer.sender import KVSender
from tests.transfer_support import engine_params, fast_config, scaled_limit, wait_until

PAGE, WINDOW = 4, 8
KINDS = ("sliding", "full", "sliding", "full", "sliding")  # gpt-oss alternates, sliding first
GEOMETRY = KVGeometry.mha(len(KINDS), kv_heads=2, head_dim=8, dtype="float32").with_layer_kinds(
    KINDS, WINDOW)


def _window(num_pages: int = 8) -> WindowPages:
    return WindowPages(GEOMETRY, num_pages, PAGE, torch.float32)


def _apply(batch) -> None:
    for src, dst, n in zip(batch.srcs.tolist(), batch.dsts.tolist(), batch.lengths.tolist()):
        ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 7, 8, 9, 12, 13, 60, 61, 64])
def test_tail_pages_cover_every_read_of_a_continuation(num_tokens: int) -> None:
    window = _window()
    tail = window.tail_pages(num_tokens)
    last_page = (num_tokens - 1) // PAGE
    assert tail.stop == last_page + 1  # the page the sequence ends in
    # attention at `num_tokens` (the next token) reads [n - W + 1, n)
    assert tail.start <= max(0, num_tokens - WINDOW + 1) // PAGE
    # a hit at the page boundary below the last token, the sequence's end or the first
    # boundary after it reads the window before it
    below = (num_tokens - 1) // PAGE * PAGE
    assert tail.start == window.first_needed_page(below)
    # never more than the window's pages plus the page being filled
    assert len(tail) <= -(-(WINDOW - 1) // PAGE) + 2


def test_droppable_keeps_exactly_the_prompt_tail() -> None:
    window = _window()
    prompt, kv_len = 30, 60
    pages = list(range(kv_len // PAGE))
    drop = set(window.droppable(list(pages), 0, kv_len, prompt))
    tail = window.tail_pages(prompt)
    current = window.first_needed_page(kv_len)
    assert drop == {i for i in range(current) if i not in tail}


def test_window_tail_copy_moves_full_layers_everywhere_sliding_only_in_the_tail() -> None:
    window = _window(num_pages=40)
    torch.manual_seed(0)
    src = torch.randn(GEOMETRY.device_shape(24, PAGE))  # one space: every layer
    dst_full = window.full_pool(40, torch.float32).device_kv
    dst_window = window.pool.device_kv
    num_tokens = 37  # 10 pages, the last partial
    src_pages = np.array([3, 4, 5, 6, 20, 21, 0, 1, 2, 11])
    dst_pages = np.array([10, 11, 12, 13, 14, 30, 31, 2, 3, 39])
    tail = window.tail_pages(num_tokens)
    dst_window_pages = np.array([7, 8, 9, 17][: len(tail)])
    batch = window_tail_copy_batch(
        KVLayout.from_tensor(src), KVLayout.from_tensor(dst_full),
        KVLayout.from_tensor(dst_window), KINDS, src_pages, dst_pages, tail, dst_window_pages)
    slab = GEOMETRY.slab_page_bytes(PAGE)
    full, sliding = GEOMETRY.layer_kinds.count("full"), GEOMETRY.layer_kinds.count("sliding")
    # bytes: the full layers of every page, the sliding layers of the tail only
    assert batch.nbytes == 2 * slab * (full * len(src_pages) + sliding * len(tail))
    _apply(batch)
    full_ids = [i for i, k in enumerate(KINDS) if k == "full"]
    sliding_ids = [i for i, k in enumerate(KINDS) if k == "sliding"]
    assert torch.equal(dst_full[:, :, dst_pages], src[full_ids][:, :, src_pages])
    assert not dst_full[:, :, np.setdiff1d(np.arange(40), dst_pages)].any()
    tail_src = src_pages[tail.start:tail.stop]
    assert torch.equal(dst_window[:, :, dst_window_pages], src[sliding_ids][:, :, tail_src])
    assert not dst_window[:, :, np.setdiff1d(np.arange(40), dst_window_pages)].any()


def test_layer_copies_are_refused_across_shapes_and_outside_the_pages() -> None:
    a = KVLayout(1 << 20, 3, 8, 256)
    with pytest.raises(ValueError, match="layer rows outside"):
        layer_copy_batch(a, [3], a, [0], np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="layouts differ"):
        layer_copy_batch(a, [0], KVLayout(1 << 30, 3, 8, 128), [0], np.array([0]),
                         np.array([0]))
    with pytest.raises(ValueError, match="source layers for"):
        layer_copy_batch(a, [0, 1], a, [0], np.array([0]), np.array([0]))
    full, window = KVLayout(1 << 30, 2, 8, 256), KVLayout(1 << 31, 3, 8, 256)
    src = KVLayout(1 << 20, 5, 8, 256)
    with pytest.raises(ValueError, match="window tail"):
        window_tail_copy_batch(src, full, window, KINDS, np.arange(3), np.arange(3),
                               range(2, 4), np.arange(2))
    with pytest.raises(ValueError, match="full and sliding layers only"):
        window_tail_copy_batch(src, full, window, KINDS[:4], np.arange(3), np.arange(3),
                               range(0, 1), np.arange(1))


def test_window_page_keys_are_chained_to_the_page_keys() -> None:
    salt = make_salt(GEOMETRY.fingerprint("gpt-oss-tiny", PAGE))
    pages = chain_page_keys(list(range(32)), PAGE, salt)
    sliding = _window().sliding_geometry.layout_key(PAGE)
    keys = window_page_keys(pages, sliding)
    assert keys == [window_page_key(key, sliding) for key in pages]
    assert len(set(keys)) == len(keys)
    assert not set(keys) & set(pages)  # never a page key
    assert not set(keys) & {state_key(key, sliding) for key in pages}  # nor a state key
    other_tenant = chain_page_keys(list(range(32)), PAGE, make_salt("fp", "tenant-b"))
    assert not set(keys) & set(window_page_keys(other_tenant, sliding))
    assert window_page_key(pages[0], sliding + ";other") != keys[0]
    with pytest.raises(ValueError, match="32 bytes"):
        window_page_key(b"short", sliding)


def _pools(seed_pages: int, dst_pages: int) -> tuple[torch.Tensor, WindowPages, torch.Tensor]:
    window = _window(num_pages=dst_pages)
    src = torch.randn(GEOMETRY.device_shape(seed_pages, PAGE),
                      generator=torch.Generator().manual_seed(7))
    return src, window, window.full_pool(dst_pages, torch.float32).device_kv


NUM_TOKENS = 37  # the room both wire tests move: 10 pages, a tail of the last ones


def _ask_for_a_tail(receiver: KVReceiver, sender: KVSender, window: WindowPages
                    ) -> tuple[np.ndarray, np.ndarray, range, np.ndarray]:
    """Decode connects and asks room 7 for NUM_TOKENS tokens: every page into its full
    pool, the window tail into sliding pages 7..; (prefill's pages, decode's pages, the
    tail's page range, decode's sliding pages)."""
    receiver.connect(sender.bootstrap_addr)
    src_pages = np.array([3, 4, 5, 6, 20, 21, 0, 1, 2, 11])
    dst_pages = np.array([10, 11, 12, 13, 14, 30, 31, 2, 3, 39])
    tail = window.tail_pages(NUM_TOKENS)
    dst_window = np.array([7, 8, 9][: len(tail)])
    receiver.request(7, sender.bootstrap_addr, dst_pages, num_tokens=NUM_TOKENS,
                     dst_window_pages=dst_window, window_first_page=tail.start)
    return src_pages, dst_pages, tail, dst_window


@pytest.mark.parametrize("engine", engine_params())
def test_the_window_tail_over_the_wire(engine: str) -> None:
    config = fast_config(engine)
    src, window, dst_full = _pools(24, 40)
    key = GEOMETRY.layout_key(PAGE)
    sender = KVSender(config, src, kv_geometry=key, layer_kinds=KINDS).start()
    receiver = KVReceiver(config, dst_full, kv_geometry=key,
                          window_kv=window.pool.device_kv).start()
    try:
        src_pages, dst_pages, tail, dst_window = _ask_for_a_tail(receiver, sender, window)
        assert sender.send(7, src_pages, PrefillReport(11, prompt_tokens=NUM_TOKENS))
        result = receiver.wait(7, scaled_limit(5.0))
        slab = GEOMETRY.slab_page_bytes(PAGE)
        assert result.nbytes == 2 * slab * (2 * len(src_pages) + 3 * len(tail))
        full_ids = [i for i, k in enumerate(KINDS) if k == "full"]
        sliding_ids = [i for i, k in enumerate(KINDS) if k == "sliding"]
        assert torch.equal(dst_full[:, :, dst_pages], src[full_ids][:, :, src_pages])
        assert torch.equal(window.pool.device_kv[:, :, dst_window],
                           src[sliding_ids][:, :, src_pages[tail.start:tail.stop]])
        untouched = np.setdiff1d(np.arange(40), dst_window)
        assert not window.pool.device_kv[:, :, untouched].any()
        wait_until(lambda: sender.poll(7) is RoomState.SUCCESS, 2.0, "success")
        assert sender.stats()["window_pages_sent"] == len(tail)
    finally:
        receiver.close()
        sender.close()


def test_a_prefill_that_cannot_split_its_layers_refuses_a_window_decode() -> None:
    config = fast_config("zmq")
    src, window, dst_full = _pools(8, 8)
    key = GEOMETRY.layout_key(PAGE)
    sender = KVSender(config, src, kv_geometry=key).start()  # no layer kinds
    receiver = KVReceiver(config, dst_full, kv_geometry=key,
                          window_kv=window.pool.device_kv).start()
    try:
        with pytest.raises(TransferError, match="window pages"):
            receiver.connect(sender.bootstrap_addr, timeout_s=scaled_limit(3.0))
    finally:
        receiver.close()
        sender.close()


def test_window_requests_are_checked_before_they_leave() -> None:
    config = fast_config("zmq")
    src, window, dst_full = _pools(8, 8)
    receiver = KVReceiver(config, dst_full, window_kv=window.pool.device_kv)
    plain = KVReceiver(config, dst_full)
    with pytest.raises(ValueError, match="needs the window tail"):
        receiver.request(1, "tcp://127.0.0.1:1", [0, 1, 2], 12)
    with pytest.raises(ValueError, match="does not end the prompt"):
        receiver.request(1, "tcp://127.0.0.1:1", [0, 1, 2], 12, dst_window_pages=[5],
                         window_first_page=1)
    with pytest.raises(ValueError, match="without a window pool"):
        plain.request(1, "tcp://127.0.0.1:1", [0, 1, 2], 12, dst_window_pages=[5],
                      window_first_page=2)


def test_window_fields_need_version_9_and_round_trip() -> None:
    register = Register("d", "zmq", b"s", 4096, 2, 8, 512, 2, "k", 0, 0, 8192, 3, 8)
    request = RoomRequest(1, pack_pages([0, 1, 2]), 12, 0, window_pages=pack_pages([5, 6]),
                          window_first_page=1)
    assert wire_version(register) == wire_version(request) == 9
    assert decode(encode(register), 1 << 20) == register
    assert decode(encode(request), 1 << 20).window_page_ids().tolist() == [5, 6]
    assert wire_version(RoomRequest(1, pack_pages([0]), 4)) == 4  # no window: as before


def _split_sender(config, num_pages: int) -> tuple[KVSender, torch.Tensor, torch.Tensor]:
    """A prefill keeping window pages: its full pool and its sliding pool, random."""
    prefill = _window(num_pages=num_pages)
    full = prefill.full_pool(num_pages, torch.float32).device_kv
    gen = torch.Generator().manual_seed(3)
    full.copy_(torch.randn(full.shape, generator=gen))
    sliding = prefill.pool.device_kv
    sliding.copy_(torch.randn(sliding.shape, generator=gen))
    sender = KVSender(config, full, kv_geometry=GEOMETRY.layout_key(PAGE), layer_kinds=KINDS,
                      window_kv=sliding).start()
    return sender, full, sliding


@pytest.mark.parametrize("freed_in_tail", [False, True])
def test_a_prefill_with_window_pages_sends_the_tail_from_its_window_pool(
        freed_in_tail: bool) -> None:
    """Both sides keep window pages: the full layers of every page from prefill's full
    pool, the sliding layers of the tail from its window pool (only those pages need be
    there). A tail page prefill freed fails the room ("invalid"), nothing guessed."""
    config = fast_config("zmq")
    sender, src_full, src_sliding = _split_sender(config, 24)
    decode = _window(num_pages=40)
    dst_full = decode.full_pool(40, torch.float32).device_kv
    receiver = KVReceiver(config, dst_full, kv_geometry=GEOMETRY.layout_key(PAGE),
                          window_kv=decode.pool.device_kv).start()
    try:
        src_pages, dst_pages, tail, dst_window = _ask_for_a_tail(receiver, sender, decode)
        src_window: list[int | None] = [None] * tail.start + [5, 9, 17][: len(tail)]
        if freed_in_tail:
            src_window[tail.start] = None
        assert sender.send(7, src_pages, PrefillReport(11, prompt_tokens=NUM_TOKENS),
                           window_page_ids=src_window)
        if freed_in_tail:
            wait_until(lambda: sender.poll(7) is RoomState.FAILED, 2.0, "failed")
            return
        result = receiver.wait(7, scaled_limit(5.0))
        assert result.nbytes == 2 * GEOMETRY.slab_page_bytes(PAGE) * (
            2 * len(src_pages) + 3 * len(tail))
        assert torch.equal(dst_full[:, :, dst_pages], src_full[:, :, src_pages])
        sent = [page for page in src_window if page is not None]
        assert torch.equal(decode.pool.device_kv[:, :, dst_window], src_sliding[:, :, sent])
    finally:
        receiver.close()
        sender.close()


def test_a_prefill_with_window_pages_refuses_a_decode_without_them() -> None:
    """Prefill freed the sliding pages behind each window: a decode wanting every page's
    sliding layers (no window pool) cannot be served."""
    config = fast_config("zmq")
    sender, src_full, _ = _split_sender(config, 8)
    receiver = KVReceiver(config, torch.zeros(GEOMETRY.device_shape(8, PAGE)),
                          kv_geometry=GEOMETRY.layout_key(PAGE)).start()
    try:
        with pytest.raises(TransferError, match="keeps window pages"):
            receiver.connect(sender.bootstrap_addr, timeout_s=scaled_limit(3.0))
    finally:
        receiver.close()
        sender.close()
