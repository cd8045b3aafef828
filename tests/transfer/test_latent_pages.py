"""MLA latent pools through every transfer engine, and registration refusing other geometries.

A latent pool is `[L, 1, P, S, 1, D]`: one slab per layer, so a page is L runs, not 2 L.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdcache.engine.kv_geometry import KVGeometry
from pdcache.transfer.errors import TransferError
from pdcache.transfer.messages import PrefillReport, Register, decode, encode, wire_version
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.rooms import RoomState
from pdcache.transfer.sender import KVSender
from tests.transfer_support import engine_params, fast_config, make_pool, scaled_limit, wait_until

LAYERS, PAGE, LATENT = 4, 4, 32  # 512-byte slab pages, as tests.transfer_support's MHA pool
MLA = KVGeometry.mla(LAYERS, kv_lora_rank=24, rope_dim=8, dtype="float32")
MHA = KVGeometry.mha(LAYERS, kv_heads=2, head_dim=16, dtype="float32")


def latent_pool(num_pages: int, seed: int | None) -> torch.Tensor:
    shape = MLA.device_shape(num_pages, PAGE)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("engine", engine_params())
def test_latent_pages_arrive_byte_identical(engine: str) -> None:
    config = fast_config(engine)
    src, dst = latent_pool(24, seed=5), latent_pool(40, seed=None)
    key = MLA.layout_key(PAGE)
    sender = KVSender(config, src, kv_geometry=key).start()
    receiver = KVReceiver(config, dst, kv_geometry=key).start()
    try:
        receiver.connect(sender.bootstrap_addr)
        rng = np.random.default_rng(3)
        src_pages, dst_pages = rng.choice(24, 9, replace=False), rng.choice(40, 9, replace=False)
        receiver.request(7, sender.bootstrap_addr, dst_pages, num_tokens=9 * PAGE)
        assert sender.send(7, src_pages, PrefillReport(11, prompt_tokens=9 * PAGE))
        result = receiver.wait(7, scaled_limit(5.0))
        assert result.nbytes == LAYERS * 1 * 9 * MLA.slab_page_bytes(PAGE)
        assert torch.equal(dst[:, :, dst_pages], src[:, :, src_pages])
        untouched = np.setdiff1d(np.arange(40), dst_pages)
        assert not dst[:, :, untouched].any()
        wait_until(lambda: sender.poll(7) is RoomState.SUCCESS, 2.0, "success")
    finally:
        receiver.close()
        sender.close()


def _refusal(sender_pool, sender_key, receiver_pool, receiver_key) -> str:
    config = fast_config("zmq")
    sender = KVSender(config, sender_pool, kv_geometry=sender_key).start()
    receiver = KVReceiver(config, receiver_pool, kv_geometry=receiver_key).start()
    try:
        receiver.connect(sender.bootstrap_addr, timeout_s=scaled_limit(3.0))
        return ""
    except TransferError as exc:
        return str(exc)
    finally:
        receiver.close()
        sender.close()


def test_a_latent_decode_is_refused_by_a_kv_prefill_of_equal_page_bytes() -> None:
    """Same layers and 512-byte slab pages, 1 slab against 2: addressed as K/V pairs, a
    latent pool would be written out of its bounds; registration says why instead."""
    assert MLA.slab_page_bytes(PAGE) == MHA.slab_page_bytes(PAGE)
    why = _refusal(make_pool(8, seed=1), "", latent_pool(8, seed=None), "")
    assert "layout mismatch" in why and "1 slabs" in why


def test_registration_compares_the_geometry_key_when_both_send_one() -> None:
    pool = make_pool(8, seed=1)
    other = KVGeometry.mha(LAYERS, kv_heads=2, head_dim=16, dtype="bfloat16").layout_key(PAGE)
    why = _refusal(pool, MHA.layout_key(PAGE), make_pool(8, seed=None), other)
    assert "geometry mismatch" in why
    # an older decode (no key sent) is checked by its byte counts alone
    assert _refusal(pool, MHA.layout_key(PAGE), make_pool(8, seed=None), "") == ""


def test_register_geometry_fields_need_version_7_and_default_for_older_peers() -> None:
    old = Register("d", "zmq", b"s", 4096, LAYERS, 8, 512)
    assert wire_version(old) == 4  # a decode without the new fields still talks to v4-6
    new = Register("d", "zmq", b"s", 4096, LAYERS, 8, 512, 1, MLA.layout_key(PAGE))
    assert wire_version(new) == 7
    assert decode(encode(new), 1 << 20) == new
    assert decode(encode(old), 1 << 20).num_slabs == 2
