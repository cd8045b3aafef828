"""`WriteBatch.split` bounds every engine batch by bytes, contiguous pages included: a room
whose pages coalesce into one run is cut into pieces of at most `max_batch_bytes`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdcache.transfer.layout import KVLayout, WriteBatch, page_copy_batch
from pdcache.transfer.messages import PrefillReport
from pdcache.transfer.receiver import KVReceiver
from pdcache.transfer.sender import KVSender
from tests.transfer_support import fast_config

MIB = 1 << 20


def _contiguous_room(num_pages: int) -> WriteBatch:
    """Every page of a [4, 2, num_pages] pool of 256 KiB pages, onto the same pages of a
    remote pool: one coalesced run (no memory behind the addresses: only arithmetic)."""
    src = KVLayout(1 << 40, 4, num_pages, 256 << 10)
    dst = KVLayout(1 << 44, 4, num_pages, 256 << 10)
    pages = np.arange(num_pages)
    return page_copy_batch(src, dst, pages, pages)


def test_a_200_mib_contiguous_room_is_cut_into_batches_within_the_bound() -> None:
    batch = _contiguous_room(100)  # 4 layers × 2 slabs × 100 pages × 256 KiB = 200 MiB
    assert len(batch) == 1 and batch.nbytes == 200 * MIB
    parts = batch.split(1024, 64 * MIB)
    assert [p.nbytes for p in parts] == [64 * MIB, 64 * MIB, 64 * MIB, 8 * MIB]
    srcs = np.concatenate([p.srcs for p in parts])
    dsts = np.concatenate([p.dsts for p in parts])
    lengths = np.concatenate([p.lengths for p in parts])
    # the same bytes, in order, each piece where the previous one ended
    assert srcs[0] == batch.srcs[0] and dsts[0] == batch.dsts[0]
    assert (srcs[1:] == srcs[:-1] + lengths[:-1]).all()
    assert (dsts[1:] - srcs[1:] == batch.dsts[0] - batch.srcs[0]).all()
    assert int(lengths.sum()) == 200 * MIB


def test_entries_are_cut_and_grouped_by_both_bounds() -> None:
    batch = WriteBatch(np.array([0, 1000, 5000]), np.array([10_000, 20_000, 30_000]),
                       np.array([250, 700, 100]))
    parts = batch.split(max_entries=2, max_bytes=300)
    assert [(p.srcs.tolist(), p.dsts.tolist(), p.lengths.tolist()) for p in parts] == [
        ([0], [10_000], [250]),
        ([1000], [20_000], [300]), ([1300], [20_300], [300]),
        ([1600, 5000], [20_600, 30_000], [100, 100]),
    ]
    whole = batch.split(10, 1 << 30)  # within both bounds: one batch, unchanged
    assert [(p.srcs.tolist(), p.lengths.tolist()) for p in whole] == [([0, 1000, 5000],
                                                                         [250, 700, 100])]
    with pytest.raises(ValueError):
        batch.chunked(0)


def test_a_contiguous_room_travels_in_bounded_batches_byte_exact() -> None:
    config = fast_config("zmq", max_batch_bytes=4 * MIB)
    shape = (4, 2, 8, 64, 8, 128)  # 256 KiB pages: 16 MiB, one contiguous run
    src = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    dst = torch.zeros(shape)
    sender = KVSender(config, src).start()
    receiver = KVReceiver(config, dst).start()
    try:
        receiver.request(9, sender.bootstrap_addr, np.arange(8), num_tokens=8 * 64)
        assert sender.send(9, np.arange(8), PrefillReport(3))
        assert receiver.wait(9, 10.0).nbytes == 16 * MIB
        assert torch.equal(dst, src)
        assert receiver.engine.counters["batches_served"] == 4  # 16 MiB / 4 MiB
        assert receiver.engine.counters["bytes_served"] == 16 * MIB
    finally:
        receiver.close()
        sender.close()
