"""Picks a kernel implementation by name or by device.

Backends: `reference` (plain torch, defines correctness), `torch` (fast torch), `numba` (the
torch backend with numba-compiled parallel page copies: the default on CPU when numba is
installed, else `torch`), `triton` (default on CUDA when triton is installed). The choice is
a `KernelSet(name)` held by whoever calls the kernels: the engine builds one from
`EngineConfig.kernels` (a topology's `[node] kernels` or `--kernels`) and hands it to the
model (through `ForwardBatch.kernels`), HiCache and the decode offload manager; benchmarks
and tests pick one with `KernelSet("reference")` or `KERNEL_BACKENDS.get(name)()`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from types import ModuleType

import torch

from pdcache.utils.registry import Registry

KERNEL_BACKENDS: Registry[ModuleType] = Registry("kernel backend")
KERNEL_BACKENDS.register("reference", "pdcache.kernels.backends:reference_backend")
KERNEL_BACKENDS.register("torch", "pdcache.kernels.backends:torch_backend")
KERNEL_BACKENDS.register("triton", "pdcache.kernels.backends:triton_backend", package="triton")
KERNEL_BACKENDS.register("numba", "pdcache.kernels.backends:numba_backend", package="numba")

AUTO = "auto"  # choose per call by the tensors' devices

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

    `name="auto"` chooses per call by the devices of the tensor arguments: triton when any is
    on CUDA (and triton is installed), else numba (when installed) or torch. Another name
    (one of `KERNEL_BACKENDS`) forces that backend. Holds only a cache of imported backend
    modules (filled from whichever thread calls first; a race imports a module twice, which
    is harmless).
    """

    def __init__(self, name: str | None = AUTO) -> None:
        self.name = None if name in (None, AUTO) else name
        if self.name is not None and self.name not in KERNEL_BACKENDS:
            raise KeyError(
                f"unknown kernel backend '{self.name}'; "
                f"choose one of {[AUTO, *KERNEL_BACKENDS.names()]}"
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
