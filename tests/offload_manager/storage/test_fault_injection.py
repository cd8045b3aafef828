"""`[storage] fault_injection`: the chaos-only wrapper that delays every storage call.

Reads and writes are delayed by what the control file says, and not otherwise; without the key
no wrapper exists at all; the control file is re-read at most every REREAD_S; a relative or
missing control file refuses to open (the key cannot be enabled by accident).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from pdcache.config import parse_topology
from pdcache.offload_manager.storage import create_backend
from pdcache.offload_manager.storage.config import StorageConfig, storage_keys_from_spec
from pdcache.offload_manager.storage.fault_injection import (
    REREAD_S,
    DelayInjectingBackend,
    read_delay_file,
)
from pdcache.offload_manager.storage.file import FileBackend

PAGE_BYTES = 4096
DELAY_S = 0.3


def config(tmp_path: Path, backend: str = "file", **over: object) -> StorageConfig:
    values: dict[str, object] = dict(
        backend=backend,
        path=str(tmp_path / "store"),
        page_bytes=PAGE_BYTES,
        capacity_pages=16,
        fingerprint="fp",
        num_data_files=1,
    )
    values.update(over)
    return StorageConfig(**values)  # type: ignore[arg-type]


def control(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "delay"
    path.write_text(text)
    return path


def keys(n: int) -> list[bytes]:
    return [bytes([9, i]) * 16 for i in range(n)]


def pages(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return list(torch.randint(0, 256, (n, PAGE_BYTES), dtype=torch.uint8, generator=gen))


def timed(fn, *args) -> float:  # noqa: ANN001 - any backend call
    started = time.monotonic()
    fn(*args)
    return time.monotonic() - started


@pytest.mark.parametrize("backend_name", ["file", "hf3fs"])
def test_calls_wait_the_control_files_delay(tmp_path: Path, backend_name: str) -> None:
    path = control(tmp_path, f"{DELAY_S}\n")
    backend = create_backend(config(tmp_path, backend_name, fault_injection=str(path)))
    try:
        assert isinstance(backend, DelayInjectingBackend)
        ks, ps = keys(2), pages(2)
        assert timed(backend.put_from, ks, ps) >= DELAY_S
        out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in ks]
        assert timed(backend.get_into, ks, out) >= DELAY_S
        assert all(torch.equal(a, b) for a, b in zip(out, ps))  # delayed, not changed
        assert timed(backend.exists_prefix, ks) >= DELAY_S
        stats = backend.stats()
        assert stats["injected_delays"] == 3
        assert stats["injected_delay_ms"] == 3 * int(DELAY_S * 1000)
        assert stats["pages_written"] == 2 and stats["pages_read"] == 2  # the inner counters
    finally:
        backend.close()


def test_zero_in_the_control_file_means_no_delay(tmp_path: Path) -> None:
    path = control(tmp_path, "0\n")
    backend = create_backend(config(tmp_path, fault_injection=str(path)))
    try:
        ks, ps = keys(2), pages(2)
        assert timed(backend.put_from, ks, ps) < DELAY_S
        assert backend.stats()["injected_delays"] == 0
    finally:
        backend.close()


def test_without_the_key_there_is_no_wrapper(tmp_path: Path) -> None:
    control(tmp_path, f"{DELAY_S}\n")  # a control file lying around changes nothing
    backend = create_backend(config(tmp_path))
    try:
        assert type(backend) is FileBackend
        assert timed(backend.put_from, keys(2), pages(2)) < DELAY_S
        assert "injected_delays" not in backend.stats()
    finally:
        backend.close()


def test_control_file_is_reread_at_most_every_reread_s(tmp_path: Path) -> None:
    path = control(tmp_path, "0")
    now = [100.0]
    backend = DelayInjectingBackend(create_backend(config(tmp_path)), path, clock=lambda: now[0])
    try:
        assert backend.current_delay_s() == 0.0
        path.write_text("0.25")
        now[0] += REREAD_S * 0.9
        assert backend.current_delay_s() == 0.0  # cached value still served
        now[0] += REREAD_S * 0.2
        assert backend.current_delay_s() == 0.25  # stale: re-read
        path.write_text("0.5")
        now[0] += REREAD_S * 0.5
        assert backend.current_delay_s() == 0.25
        now[0] += REREAD_S * 0.6
        assert backend.current_delay_s() == 0.5
        assert backend.keys() == []  # tools pass through to the wrapped backend
    finally:
        backend.close()


def test_the_wrapper_created_from_config_rereads_the_control_file(tmp_path: Path) -> None:
    path = control(tmp_path, "0")
    backend = create_backend(config(tmp_path, fault_injection=str(path)))
    try:
        assert isinstance(backend, DelayInjectingBackend)
        path.write_text("0.25")
        deadline = time.monotonic() + 20 * REREAD_S
        while backend.current_delay_s() != 0.25 and time.monotonic() < deadline:
            time.sleep(REREAD_S / 5)
        assert backend.current_delay_s() == 0.25
    finally:
        backend.close()


@pytest.mark.parametrize(
    "text,delay",
    [("", 0.0), ("soon", 0.0), ("-3", 0.0), ("nan", 0.0), ("0.125\n", 0.125), ("1e9", 600.0)],
)
def test_control_file_contents(tmp_path: Path, text: str, delay: float) -> None:
    assert read_delay_file(control(tmp_path, text)) == delay
    assert read_delay_file(tmp_path / "absent") == 0.0


def test_missing_or_relative_control_file_refuses_to_open(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such control file"):
        create_backend(config(tmp_path, fault_injection=str(tmp_path / "absent")))
    with pytest.raises(ValueError, match="absolute path"):
        create_backend(config(tmp_path, fault_injection="delay"))


def test_topology_key_reaches_the_storage_config(tmp_path: Path) -> None:
    text = """
[model]
preset = "tiny"
[storage]
backend = "file"
path = "/tmp/s"
fault_injection = "/tmp/chaos/delay"
[[node]]
name = "u0"
role = "unified"
port = 30001
"""
    keys_ = storage_keys_from_spec(parse_topology(text, "t.toml").storage)
    assert keys_["fault_injection"] == "/tmp/chaos/delay"
    plain = parse_topology(text.replace('fault_injection = "/tmp/chaos/delay"\n', ""), "t.toml")
    assert "fault_injection" not in storage_keys_from_spec(plain.storage)


def test_layer_major_reads_are_delayed_too(tmp_path: Path) -> None:
    """The layer-streamed prefetch reads through `read_layers` (storage/layer_reads.py): the
    wrapper says whether the wrapped backend streams layers and delays those reads like
    `get_into`, not forwarding them undelayed through `__getattr__`."""
    from pdcache.offload_manager.storage.layer_reads import LayerStream

    layers = 4
    path = control(tmp_path, "0")
    backend = create_backend(
        config(tmp_path, fault_injection=str(path), num_layers=layers, page_size=4, dtype="uint8")
    )
    try:
        assert isinstance(backend, DelayInjectingBackend) and backend.streams_layers
        ks, ps = keys(2), pages(2)
        assert all(backend.put_from(ks, ps))
        path.write_text(f"{DELAY_S}\n")
        deadline = time.monotonic() + 20 * REREAD_S
        while backend.current_delay_s() != DELAY_S and time.monotonic() < deadline:
            time.sleep(REREAD_S / 5)
        out = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in ks]
        stream = LayerStream(len(ks), layers)
        assert timed(backend.read_layers, ks, out, stream) >= DELAY_S
        assert stream.wait_done() == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(out, ps))  # delayed, not changed
        assert backend.stats()["injected_delays"] == 1
    finally:
        backend.close()


def test_streams_layers_follows_the_wrapped_backend(tmp_path: Path) -> None:
    class PageOnly(FileBackend):
        streams_layers = False  # e.g. a backend without positional reads

    inner = PageOnly(config(tmp_path))
    assert DelayInjectingBackend(inner).streams_layers is False
    assert DelayInjectingBackend(FileBackend(config(tmp_path))).streams_layers is True
