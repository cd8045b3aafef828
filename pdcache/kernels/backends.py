"""Factories of kernel backends (imported lazily by the dispatcher)."""

from __future__ import annotations

from types import ModuleType


def torch_backend() -> ModuleType:
    from pdcache.kernels import reference

    return reference


def triton_backend() -> ModuleType:
    from pdcache.kernels import triton_kernels

    return triton_kernels
