"""DecodeOffloadManager serves staged pages to pulls (docs/design.md §4.10): a page is
servable from the end of its device → staging copy to the end of its storage write, as the
stored page object; a page being encoded for a pull is pinned, so the write's end does not
free it under the send (it is freed at the unpin), and nothing leaks."""

from __future__ import annotations

import threading
import time

import pdcache.offload_manager.decode_offload as decode_offload
from pdcache.engine.page_keys import chain_page_keys, make_salt
from pdcache.offload_manager.decode_offload import DecodeOffloadManager
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig
from pdcache.offload_manager.storage.page_format import Verdict, verify_page
from tests.offload_manager.test_decode_offload import DIM, FP, HEADS, LAYERS, PAGE, device_kv

PAGE_BYTES = LAYERS * 2 * PAGE * HEADS * DIM * 4


def test_a_page_under_a_send_outlives_its_write(tmp_path, monkeypatch) -> None:
    config = StorageConfig(backend="file", path=str(tmp_path), page_bytes=PAGE_BYTES,
                           capacity_pages=16, fingerprint=FP, num_layers=LAYERS, page_size=PAGE,
                           dtype="float32", page_mac_key=bytes(32), write_delay_s=0.2)
    kv = device_kv()
    mgr = DecodeOffloadManager(kv, create_backend(config), FP, staging_pages=4, stride_pages=8)
    mgr.start()
    encoding, release = threading.Event(), threading.Event()
    real_encode = decode_offload.encode_object

    def paused_encode(*args, **kwargs):  # the send is slow: the write ends meanwhile
        encoding.set()
        assert release.wait(10)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(decode_offload, "encode_object", paused_encode)
    tokens = list(range(PAGE + 1))
    key = chain_page_keys(tokens, PAGE, make_salt(FP))[0]
    assert mgr.staged_objects([key]) == [None]  # not scheduled yet: nothing to serve
    released = threading.Event()
    mgr.track("r")
    mgr.finish("r", tokens, [3], released.set)
    assert released.wait(30)
    got: list = []
    sender = threading.Thread(target=lambda: got.extend(mgr.staged_objects([key])))
    sender.start()
    assert encoding.wait(10)
    deadline = time.monotonic() + 10
    while mgr.snapshot()["writes"] < 1:  # the write lands while the page is being sent
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert mgr.staging.num_free == mgr.staging.capacity - 1  # pinned: not freed
    assert not mgr.idle  # a page still held by the send: check() must not call it leaked
    assert not mgr.wait_idle(0.05)
    release.set()
    sender.join(10)
    obj = got[0]
    payload = memoryview(obj)[128:]
    assert verify_page(config.page_spec(), key, obj[:128], payload, len(obj)) == (
        Verdict.OK, "decode")
    assert bytes(payload) == kv[:, :, 3].contiguous().numpy().tobytes()
    assert mgr.staging.num_free == mgr.staging.capacity  # freed at the unpin
    monkeypatch.setattr(decode_offload, "encode_object", real_encode)
    assert mgr.staged_objects([key]) == [None]  # written: served from storage now
    assert mgr.wait_idle(10)
    mgr.check()
    mgr.close()
