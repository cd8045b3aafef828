"""Name-keyed registries whose entries import their heavy dependencies lazily."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message names the package to install."""

    def __init__(self, feature: str, package: str, detail: str = "") -> None:
        msg = f"{feature} needs the package '{package}': pip install {package}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)
        self.feature = feature
        self.package = package


def import_optional(module: str, feature: str, package: str):
    """Import `module` or raise MissingDependencyError naming `package`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(feature, package, str(exc)) from exc


@dataclass(frozen=True)
class _Entry:
    target: str  # "package.module:attribute", imported on first use
    package: str | None  # pip package that provides the optional dependency


class Registry(Generic[T]):
    """Maps names to factories given as import paths, so nothing heavy loads at import time."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, target: str, package: str | None = None) -> None:
        self._entries[name] = _Entry(target, package)

    def unregister(self, name: str) -> None:
        """Forget `name` (a plugin or test that registered it for a while); absent: no-op."""
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def get(self, name: str) -> Callable[..., T]:
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"unknown {self.kind} '{name}'; choose one of {self.names()}")
        module_name, _, attr = entry.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            if entry.package is None:
                raise
            raise MissingDependencyError(f"{self.kind} '{name}'", entry.package, str(exc)) from exc
        return getattr(module, attr)
