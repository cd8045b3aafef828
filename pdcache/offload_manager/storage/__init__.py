"""Storage tier backends (docs/design.md §4.4), chosen by name from a StorageConfig.

Backends load lazily: `create_backend(config)` imports only the chosen one, and a missing
optional dependency (mooncake, the 3FS usrbio client) raises MissingDependencyError naming it.
Nothing heavy (torch) is imported by this package itself, so the metadata service starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdcache.utils.registry import Registry

if TYPE_CHECKING:
    from pdcache.offload_manager.storage.base import StorageBackend
    from pdcache.offload_manager.storage.config import StorageConfig

BACKENDS: Registry[StorageBackend] = Registry("storage backend")
BACKENDS.register("hf3fs", "pdcache.offload_manager.storage.hf3fs:Hf3fsBackend")
BACKENDS.register("file", "pdcache.offload_manager.storage.file:FileBackend")
BACKENDS.register(
    "mooncake",
    "pdcache.offload_manager.storage.mooncake_store:MooncakeStoreBackend",
    package="mooncake-transfer-engine-non-cuda",
)


def create_backend(config: StorageConfig) -> StorageBackend:
    """The backend named by `config.backend`, opened with `config`; wrapped in
    `fault_injection.DelayInjectingBackend` when `config.write_delay_s` (an emulated slow
    store) or `config.fault_injection` (the chaos-only control file, docs/chaos.md) is set."""
    backend = BACKENDS.get(config.backend)(config)
    if not config.fault_injection and config.write_delay_s <= 0:
        return backend
    from pathlib import Path

    from pdcache.offload_manager.storage.fault_injection import DelayInjectingBackend

    control = Path(config.fault_injection) if config.fault_injection else None
    try:
        return DelayInjectingBackend(backend, control, config.write_delay_s)
    except BaseException:
        backend.close()
        raise


def __getattr__(name: str) -> Any:
    if name == "StorageBackend":
        from pdcache.offload_manager.storage.base import StorageBackend

        return StorageBackend
    if name == "StorageConfig":
        from pdcache.offload_manager.storage.config import StorageConfig

        return StorageConfig
    raise AttributeError(name)


__all__ = ["BACKENDS", "StorageBackend", "StorageConfig", "create_backend"]
