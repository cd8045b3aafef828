"""Layer-major reads (`read_layers`, storage/layer_reads.py) of the file and hf3fs backends:
byte-identical with `get_into`; the stream reports the header prefix before any layer after
the first group, then every layer in order; a missing page or a page of another key ends the
usable prefix; a payload that does not verify is reported failed after its layers were
delivered (and counted as a rejected page); a cancelled stream stops reading."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.offload_manager.storage.layer_reads import LayerStream
from pdcache.offload_manager.storage.page_format import HEADER_BYTES

LAYERS = 4
PAGE_BYTES = LAYERS * 1024
PAGES = 12


def _backend(kind: str, path: Path):
    cfg = StorageConfig(backend=kind, path=str(path), page_bytes=PAGE_BYTES,
                        fingerprint="layer-reads-test", num_layers=LAYERS, page_size=4,
                        dtype="uint8", capacity_pages=64)
    return create_backend(cfg)


def _stored(kind: str, path: Path):
    backend = _backend(kind, path)
    keys = [bytes([i + 1]) * 32 for i in range(PAGES)]
    pages = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(7))
    assert all(backend.put_from(keys, list(pages)))
    return backend, keys, pages


class RecordingStream(LayerStream):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, int]] = []

    def headers_read(self, ok_prefix, origins) -> None:
        self.log.append(("headers", ok_prefix))
        super().headers_read(ok_prefix, origins)

    def layer_read(self, layer: int) -> None:
        self.log.append(("layer", layer))
        super().layer_read(layer)


@pytest.mark.parametrize("kind", ["file", "hf3fs"])
@pytest.mark.parametrize("per_read", [1, 3])
def test_layer_major_read_equals_get_into(kind, per_read, tmp_path):
    backend, keys, pages = _stored(kind, tmp_path)
    try:
        assert backend.streams_layers
        dest = torch.zeros_like(pages)
        stream = RecordingStream(PAGES, LAYERS, per_read)
        origins: list = [None] * PAGES
        assert all(backend.read_layers(keys, list(dest), stream, origins))
        assert torch.equal(dest, pages) and origins == ["prefill"] * PAGES
        groups = list(range(per_read - 1, LAYERS - 1, per_read)) + [LAYERS - 1]
        assert stream.log == [("headers", PAGES)] + [("layer", g) for g in groups]
        assert stream.wait_done() == [True] * PAGES
        assert backend.stats()["pages_read"] == PAGES
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["file", "hf3fs"])
def test_missing_or_foreign_page_ends_the_prefix(kind, tmp_path):
    backend, keys, pages = _stored(kind, tmp_path)
    try:
        keys = list(keys)
        keys[5] = b"\xee" * 32  # never stored
        dest = torch.zeros_like(pages)
        stream = LayerStream(PAGES, LAYERS)
        ok = backend.read_layers(keys, list(dest), stream)
        assert ok == [True] * 5 + [False] * (PAGES - 5)
        assert stream.header_prefix()[0] == 5
        assert torch.equal(dest[:5], pages[:5]) and not dest[6:].any()
        assert backend.stats()["misses"] == 1
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["file", "hf3fs"])
def test_bad_payload_fails_after_its_layers_were_delivered(kind, tmp_path):
    backend, keys, pages = _stored(kind, tmp_path)
    try:
        blob = backend.read_object(keys[3])
        flipped = bytearray(blob)
        flipped[HEADER_BYTES + PAGE_BYTES - 1] ^= 0xFF  # last layer of page 3
        assert backend.write_object(keys[3], bytes(flipped))
        dest = torch.zeros_like(pages)
        stream = LayerStream(PAGES, LAYERS)
        ok = backend.read_layers(keys, list(dest), stream)
        assert stream.header_prefix()[0] == PAGES and stream.layers_read == LAYERS
        assert ok == [i != 3 for i in range(PAGES)] == stream.wait_done()
        assert backend.stats()["rejected_checksum_pages"] == 1
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["file", "hf3fs"])
def test_cancelled_stream_stops_reading(kind, tmp_path):
    backend, keys, pages = _stored(kind, tmp_path)
    try:
        gate = threading.Event()

        class Cancelling(LayerStream):
            def layer_read(self, layer: int) -> None:
                super().layer_read(layer)
                self.cancelled.set()  # the consumer left after layer 0
                gate.set()

        dest = torch.zeros_like(pages)
        stream = Cancelling(PAGES, LAYERS)
        ok = backend.read_layers(keys, list(dest), stream)
        assert gate.is_set() and stream.layers_read == 1 and stream.done
        assert ok == [False] * PAGES  # nothing verified, nothing served
        layer = PAGE_BYTES // LAYERS
        assert torch.equal(dest[:, :layer], pages[:, :layer]) and not dest[:, layer:].any()
    finally:
        backend.close()


def test_waits_end_at_the_deadline_and_cancel_the_read():
    """A consumer (the engine thread) waits for a hung read at most until the stream's
    deadline: then the stream is timed out, cancelled, and every page counts as failed, even
    if the read reports success later; `done` stays the IO thread's (its buffers in use)."""
    import time

    stream = LayerStream(3, LAYERS, deadline=time.monotonic() + 0.2)
    stream.headers_read(3, ["prefill"] * 3)
    stream.layer_read(0)
    assert stream.wait_layer(0)
    started = time.monotonic()
    assert not stream.wait_layer(1)  # nobody reads layer 1
    assert 0.1 <= time.monotonic() - started < 5
    assert stream.timed_out and stream.cancelled.is_set() and not stream.done
    assert not stream.wait_layer(2)  # no second wait
    stream.finish([True, True, True])  # the read ends late
    assert stream.done and stream.wait_done() == [False] * 3
    unbounded = LayerStream(1, LAYERS)
    threading.Timer(0.2, unbounded.finish, [[True]]).start()
    assert unbounded.wait_done() == [True] and not unbounded.timed_out
