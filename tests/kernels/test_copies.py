"""Copy kernels (reference, fast torch, numba) against per-block oracles, byte for byte."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdcache.kernels import checks, dispatch, testing
from pdcache.kernels.dispatch import KERNEL_BACKENDS, KernelSet

BACKENDS = ["reference", "torch"] + (["numba"] if importlib.util.find_spec("numba") else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def copy_shapes(draw) -> testing.CopyShape:
    device_pages = draw(st.integers(2, 10))
    host_pages = draw(st.integers(2, 10))
    return testing.CopyShape(
        layers=draw(st.integers(1, 4)),
        device_pages=device_pages,
        host_pages=host_pages,
        page_size=draw(st.sampled_from([1, 4, 16])),
        heads=draw(st.integers(1, 3)),
        dim=draw(st.sampled_from([4, 8, 12])),
        num_pages=draw(st.integers(0, min(device_pages, host_pages))),
        slabs=draw(st.sampled_from([1, 2])),  # 1: an MLA latent pool
    )


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(shape=copy_shapes(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31),
       per_layer=st.booleans())
def test_layout_copies_match_oracle_and_round_trip(name, shape, dtype, seed, per_layer):
    layer = seed % shape.layers if per_layer else None
    testing.check_copies(KERNEL_BACKENDS.get(name)(), shape, dtype, seed, layer=layer)


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=15, deadline=None)
@given(shape=copy_shapes(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31))
def test_pack_unpack_store_match_oracle(name, shape, dtype, seed):
    testing.check_pack_store(KERNEL_BACKENDS.get(name)(), shape, dtype, seed)


def test_torch_backend_equals_reference_on_runs_and_scattered_ids():
    """Consecutive ids (merged into one block copy) next to scattered ones."""
    gen = torch.Generator().manual_seed(7)
    device_kv = testing.random_pool((3, 2, 12, 4, 2, 8), torch.bfloat16, gen)
    dev_ids = torch.tensor([2, 3, 4, 9, 0, 1, 7])
    host_ids = torch.tensor([5, 6, 7, 0, 1, 3, 2])
    outs = []
    for name in BACKENDS:
        host_kv = torch.zeros((8, 3, 2, 4, 2, 8), dtype=torch.bfloat16)
        KERNEL_BACKENDS.get(name)().device_to_host(device_kv, host_kv, dev_ids, host_ids)
        outs.append(host_kv)
    testing.assert_bytes_equal(outs[1], outs[0], "torch vs reference")
    assert torch.count_nonzero(outs[0][4]) == 0  # host page 4 was not a destination


BAD_CALLS = {
    "dtype mismatch": lambda k, d, h: k.device_to_host(d, h.half(), torch.tensor([0]),
                                                       torch.tensor([0])),
    "page shape": lambda k, d, h: k.device_to_host(d, h[:, :1], torch.tensor([0]),
                                                   torch.tensor([0])),
    "id out of range": lambda k, d, h: k.host_to_device(h, d, torch.tensor([0]),
                                                        torch.tensor([6])),
    "negative id": lambda k, d, h: k.device_to_host(d, h, torch.tensor([-1]), torch.tensor([0])),
    "length mismatch": lambda k, d, h: k.device_to_host(d, h, torch.tensor([0, 1]),
                                                        torch.tensor([0])),
    "float ids": lambda k, d, h: k.pack_pages(d, torch.tensor([0.0]), h),
    "layer": lambda k, d, h: k.device_to_host(d, h, torch.tensor([0]), torch.tensor([0]), 2),
    "store shape": lambda k, d, h: k.store_kv(d, 0, torch.tensor([0, 1]), torch.zeros(2, 2, 8),
                                              torch.zeros(2, 2, 4)),
    "store slot": lambda k, d, h: k.store_kv(d, 0, torch.tensor([24]), torch.zeros(1, 2, 8),
                                             torch.zeros(1, 2, 8)),
}


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_raise_clear_errors(name, case):
    device_kv = torch.zeros((2, 2, 6, 4, 2, 8))
    host_kv = torch.zeros((4, 2, 2, 4, 2, 8))
    with pytest.raises(checks.KernelArgumentError):
        BAD_CALLS[case](KERNEL_BACKENDS.get(name)(), device_kv, host_kv)


def test_dispatch_defaults_on_cpu_and_honours_override(monkeypatch):
    monkeypatch.setenv("PDCACHE_KERNELS", "reference")  # no longer read: the config decides
    want = "numba" if importlib.util.find_spec("numba") else "torch"
    assert KernelSet().backend_name_for(torch.device("cpu")) == want
    assert KernelSet("auto").backend_name_for(torch.device("cpu")) == want
    monkeypatch.setattr(dispatch, "has_numba", lambda: False)
    assert KernelSet().backend_name_for(torch.device("cpu")) == "torch"
    kernels = KernelSet("reference")
    assert kernels.backend_for(torch.device("cpu")).__name__ == "pdcache.kernels.reference"
    device_kv = torch.randn(1, 2, 3, 2, 1, 4)
    host_kv = torch.zeros(2, 1, 2, 2, 1, 4)
    kernels.device_to_host(device_kv, host_kv, torch.tensor([2]), torch.tensor([1]))
    testing.assert_bytes_equal(host_kv[1], device_kv[:, :, 2], "dispatched copy")


def _numba_backend():
    pytest.importorskip("numba", reason="numba not installed (pip install numba)")
    return KERNEL_BACKENDS.get("numba")()


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_copies_odd_block_sizes_byte_by_byte(dtype):
    """Blocks whose size is not a multiple of 8 bytes take the byte-wise kernel."""
    shape = testing.CopyShape(layers=2, device_pages=7, host_pages=6, page_size=1, heads=1,
                              dim=3, num_pages=4)
    for seed, layer in ((1, None), (2, 1)):
        testing.check_copies(_numba_backend(), shape, dtype, seed, layer=layer)
    testing.check_pack_store(_numba_backend(), shape, dtype, 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numba_parallel_loop_matches_oracle(monkeypatch, dtype):
    backend = _numba_backend()
    monkeypatch.setattr(backend, "PARALLEL_MIN_BYTES", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed, page_size, slabs in ((4, 16, 2), (5, 1, 2), (6, 4, 1)):
            shape = testing.CopyShape(layers=3, device_pages=11, host_pages=9,
                                      page_size=page_size, heads=2, dim=12, num_pages=7,
                                      slabs=slabs)
            for layer in (None, 2):
                testing.check_copies(backend, shape, dtype, seed, layer=layer)
            testing.check_pack_store(backend, shape, dtype, seed)
    finally:
        torch.set_num_threads(threads)


def test_numba_leaves_big_page_views_to_torch(monkeypatch):
    """Per-layer views of small pages go through the compiled loop; views above torch's grain
    (here: all layers of a page) go to the torch backend; both land byte-exact."""
    backend = _numba_backend()
    torch_calls: list[int | None] = []
    real = backend.cpu.device_to_host

    def counting(*args, **kwargs):
        torch_calls.append(args[4] if len(args) > 4 else kwargs.get("layer"))
        return real(*args, **kwargs)

    monkeypatch.setattr(backend.cpu, "device_to_host", counting)
    gen = torch.Generator().manual_seed(3)
    device_kv = testing.random_pool((8, 2, 6, 16, 8, 64), torch.bfloat16, gen)  # 8192-elem blocks
    for layer in (1, None):
        host_kv = torch.zeros((5, 8, 2, 16, 8, 64), dtype=torch.bfloat16)
        expected = host_kv.clone()
        ids = (torch.tensor([4, 0, 5]), torch.tensor([2, 4, 0]))
        backend.device_to_host(device_kv, host_kv, *ids, layer=layer)
        KERNEL_BACKENDS.get("reference")().device_to_host(device_kv, expected, *ids, layer=layer)
        testing.assert_bytes_equal(host_kv, expected, f"layer={layer}")
    assert torch_calls == [None]


def test_numba_falls_back_for_non_contiguous_pools():
    backend = _numba_backend()
    gen = torch.Generator().manual_seed(5)
    device_kv = testing.random_pool((2, 2, 6, 4, 2, 8), torch.float32, gen)
    wide = torch.zeros((5, 2, 2, 4, 2, 16))
    host_kv = wide[..., ::2]  # a strided view: cannot be addressed as flat words
    dev_ids, host_ids = torch.tensor([4, 0, 3]), torch.tensor([1, 4, 0])
    backend.device_to_host(device_kv, host_kv, dev_ids, host_ids)
    expected = torch.zeros((5, 2, 2, 4, 2, 8))
    KERNEL_BACKENDS.get("reference")().device_to_host(device_kv, expected, dev_ids, host_ids)
    testing.assert_bytes_equal(host_kv, expected, "strided host pool")


def test_numba_copies_from_many_threads_at_once(monkeypatch):
    """Parallel launches are serialised, never lost or interleaved wrongly."""
    backend = _numba_backend()
    monkeypatch.setattr(backend, "PARALLEL_MIN_BYTES", 0)  # every copy takes the parallel loop
    threads = torch.get_num_threads()  # CI runs with OMP_NUM_THREADS=1: one thread is serial
    torch.set_num_threads(2)
    try:
        _copy_from_threads(backend)
    finally:
        torch.set_num_threads(threads)


def _copy_from_threads(backend) -> None:
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(9)
    device_kv = testing.random_pool((4, 2, 64, 16, 2, 16), torch.bfloat16, gen)
    ids = [testing.random_page_ids(32, 64, gen) for _ in range(8)]
    hosts = [torch.zeros((32, 4, 2, 16, 2, 16), dtype=torch.bfloat16) for _ in ids]

    def copy(i: int) -> None:
        for layer in range(4):
            backend.device_to_host(device_kv, hosts[i], ids[i], torch.arange(32), layer=layer)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(copy, range(8)))
    for page_ids, host_kv in zip(ids, hosts):
        testing.assert_bytes_equal(host_kv, device_kv[:, :, page_ids].permute(2, 0, 1, 3, 4, 5),
                                   "threaded copy")


def test_numba_that_fails_to_load_falls_back_to_torch(monkeypatch, caplog):
    """Installed but unusable (broken, or no way to compile): torch, with a warning; asked for
    by name: the error."""
    def broken():
        raise RuntimeError("cannot cache function: no locator available")

    monkeypatch.setattr(dispatch, "has_numba", lambda: True)
    monkeypatch.setattr(KERNEL_BACKENDS, "get", lambda name: broken if name == "numba"
                        else {"torch": lambda: dispatch.importlib.import_module(
                            "pdcache.kernels.cpu")}[name])
    with caplog.at_level("WARNING"):
        chosen = KernelSet().backend_for(torch.device("cpu"))
    assert chosen.__name__ == "pdcache.kernels.cpu"
    assert "numba copy kernels unavailable" in caplog.text
    with pytest.raises(RuntimeError, match="no locator"):
        KernelSet("numba").backend_for(torch.device("cpu"))


def test_numba_rejects_out_of_range_ids_from_any_device():
    """checks.py checks id values only on the CPU; the compiled loop checks none."""
    backend = _numba_backend()
    device_kv = torch.zeros((2, 2, 6, 4, 2, 8))
    host_kv = torch.zeros((4, 2, 2, 4, 2, 8))
    with pytest.raises(checks.KernelArgumentError, match="out of range"):
        backend._copy(device_kv, host_kv, torch.tensor([0, 6]), torch.tensor([0, 1]), 1, False)
    with pytest.raises(checks.KernelArgumentError, match="out of range"):
        backend._copy(device_kv, host_kv, torch.tensor([0, 1]), torch.tensor([4, 0]), None, True)


def test_dispatch_rejects_unknown_backend():
    with pytest.raises(KeyError, match="choose one of"):
        KernelSet("cuda-magic")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_backends_on_cuda(name, dtype):
    shape = testing.CopyShape(layers=3, device_pages=9, host_pages=7, page_size=16, heads=2,
                              dim=64, num_pages=5)
    for seed in range(2):  # even seeds pin the host pool
        testing.check_copies(KERNEL_BACKENDS.get(name)(), shape, dtype, seed, device="cuda")
        testing.check_copies(KERNEL_BACKENDS.get(name)(), shape, dtype, seed, device="cuda",
                             layer=1)
    testing.check_pack_store(KERNEL_BACKENDS.get(name)(), shape, dtype, 3, device="cuda")
