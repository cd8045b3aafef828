"""Picks a kernel implementation by device, overridable by `PDCACHE_KERNELS`.

Backends: `reference` (plain torch, defines correctness), `torch` (fast torch), `numba` (the
torch backend with numba-compiled parallel page copies: the default on CPU when numba is
installed, else `torch`), `triton` (default on CUDA when triton is installed).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from types import ModuleType

import torch

from pdcache.utils.registry import Registry

KERNEL_BACKENDS: Registry[ModuleType] = Registry("kernel backend")
KERNEL_BACKENDS.register("reference", "pdcache.kernels.backends:reference_backend")
KERNEL_BACKENDS.register("torch", "pdcache.kernels.backends:torch_backend")
KERNEL_BACKENDS.register("triton", "pdcache.kernels.backends:triton_backend", package="triton")
KERNEL_BACKENDS.register("numba", "pdcache.kernels.backends:numba_backend", package="numba")

ENV_VAR = "PDCACHE_KERNELS"

log = logging.getLogger(__name__)

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
    """Resolves each op to one implementation.

    `name=None` reads `PDCACHE_KERNELS`; if that is unset too, each call chooses by the devices
    of its tensor arguments: triton when any is on CUDA (and triton is installed), else numba
    (when installed) or torch.
    Holds only a cache of imported backend modules.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or os.environ.get(ENV_VAR) or None
        if self.name is not None and self.name not in KERNEL_BACKENDS:
            raise KeyError(
                f"unknown kernel backend '{self.name}' (from {ENV_VAR} or KernelSet); "
                f"choose one of {KERNEL_BACKENDS.names()}"
            )
        self._cache: dict[str, ModuleType] = {}

    def backend_name_for(self, device: torch.device) -> str:
        if self.name is not None:
            return self.name
        if device.type == "cuda":
            return "triton" if has_triton() else "torch"
        return "numba" if has_numba() else "torch"

    def backend_for(self, device: torch.device) -> ModuleType:
        name = self.backend_name_for(device)
        if name not in self._cache:
            self._cache[name] = self._load(name)
        return self._cache[name]

    def _load(self, name: str) -> ModuleType:
        """The backend `name`; a numba that is installed but fails to load (e.g. broken, or
        cannot compile here) gives the torch backend, unless numba was asked for by name."""
        try:
            return KERNEL_BACKENDS.get(name)()
        except Exception as exc:
            if name != "numba" or self.name == "numba":
                raise
            log.warning("numba copy kernels unavailable (%s: %s); using the torch backend",
                        type(exc).__name__, exc)
            return KERNEL_BACKENDS.get("torch")()

    def __getattr__(self, op: str):
        if op not in _OPS:
            raise AttributeError(op)

        def call(*args, **kwargs):
            return getattr(self.backend_for(_call_device(args, kwargs)), op)(*args, **kwargs)

        call.__name__ = op
        return call


def _call_device(args: tuple, kwargs: dict) -> torch.device:
    """CUDA if any tensor argument lives there (host pools are on CPU even on a GPU node)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    return tensors[0].device if tensors else torch.device("cpu")


@functools.lru_cache(maxsize=1)
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=1)
def has_numba() -> bool:
    return importlib.util.find_spec("numba") is not None


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
