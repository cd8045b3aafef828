"""Factories of kernel backends (imported lazily by the dispatcher)."""

from __future__ import annotations

from types import ModuleType


def reference_backend() -> ModuleType:
    """Plain torch indexing + one SDPA per sequence: the definition of correct."""
    from pdcache.kernels import reference

    return reference


def torch_backend() -> ModuleType:
    """Fast torch (block copies, batched decode): the default on CPU without numba."""
    from pdcache.kernels import cpu

    return cpu


def triton_backend() -> ModuleType:
    """Triton kernels: the default on CUDA; on CPU only under TRITON_INTERPRET=1."""
    from pdcache.kernels import triton_kernels

    return triton_kernels


def numba_backend() -> ModuleType:
    """numba-compiled parallel block copies (the default on CPU when numba is installed);
    store_kv and attention as the torch backend."""
    from pdcache.kernels import numba_copies

    return numba_copies
