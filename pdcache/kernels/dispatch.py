"""Picks a kernel implementation by device, overridable by `PDCACHE_KERNELS`."""

from __future__ import annotations

import functools
import os
from types import ModuleType

import torch

from pdcache.utils.registry import Registry

KERNEL_BACKENDS: Registry[ModuleType] = Registry("kernel backend")
KERNEL_BACKENDS.register("torch", "pdcache.kernels.backends:torch_backend")
KERNEL_BACKENDS.register("triton", "pdcache.kernels.backends:triton_backend", package="triton")

_OPS = (
    "store_kv",
    "device_to_host",
    "host_to_device",
    "pack_pages",
    "unpack_pages",
    "paged_attention_extend",
    "paged_attention_decode",
)


class KernelSet:
    """Resolves each op to one implementation; `name=None` chooses by tensor device."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name or os.environ.get("PDCACHE_KERNELS") or None
        self._cache: dict[str, ModuleType] = {}

    def backend_for(self, device: torch.device) -> ModuleType:
        name = self.name or ("triton" if device.type == "cuda" and _has_triton() else "torch")
        if name not in self._cache:
            self._cache[name] = KERNEL_BACKENDS.get(name)()
        return self._cache[name]

    def __getattr__(self, op: str):
        if op not in _OPS:
            raise AttributeError(op)

        def call(*args, **kwargs):
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            return getattr(self.backend_for(device), op)(*args, **kwargs)

        return call


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def default_kernels() -> KernelSet:
    """The process-wide choice (read once from `PDCACHE_KERNELS`)."""
    return KernelSet()


def _op(name: str):
    def call(*args, **kwargs):
        return getattr(default_kernels(), name)(*args, **kwargs)

    call.__name__ = name
    return call


store_kv = _op("store_kv")
device_to_host = _op("device_to_host")
host_to_device = _op("host_to_device")
pack_pages = _op("pack_pages")
unpack_pages = _op("unpack_pages")
paged_attention_extend = _op("paged_attention_extend")
paged_attention_decode = _op("paged_attention_decode")
