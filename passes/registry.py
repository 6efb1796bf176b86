"""The registry of passes by name.

Each pass module registers a factory with :func:`register` at import time. The registry imports every public
module of the packages in ``PASS_PACKAGES`` on first use, so a new pass is a new module in one of them (and a
new family of passes, e.g. LLM fusions, is one more entry in ``PASS_PACKAGES``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import pkgutil
import re
from collections.abc import Callable

import onnx_ir as ir

from passes.errors import PassError

TARGETS = ("any", "onnxruntime", "openvino")
PASS_PACKAGES = ("passes.generic", "passes.fusions", "passes.quantize")

_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclasses.dataclass(frozen=True)
class PassInfo:
    """A registered pass: ``targets`` says which runtimes it is for ("any" = portable ONNX)."""

    name: str
    targets: tuple[str, ...]
    description: str
    factory: Callable[[], ir.passes.PassBase]

    def row(self) -> dict[str, object]:
        return {"name": self.name, "targets": list(self.targets), "description": self.description}


_registry: dict[str, PassInfo] = {}
_loaded = False


def register(
    name: str, *, description: str, targets: tuple[str, ...] = ("any",)
) -> Callable[[Callable[[], ir.passes.PassBase]], Callable[[], ir.passes.PassBase]]:
    """Decorator registering a pass factory (usually the pass class itself) under ``name``."""
    if not _NAME.match(name):
        raise ValueError(f"pass name {name!r} is not lower-case-with-dashes")
    if not targets or not set(targets) <= set(TARGETS):
        raise ValueError(f"pass {name!r}: targets {targets!r} must be a non-empty subset of {TARGETS}")
    if not description or "\n" in description:
        raise ValueError(f"pass {name!r}: the description must be one line")

    def decorate(factory: Callable[[], ir.passes.PassBase]) -> Callable[[], ir.passes.PassBase]:
        if name in _registry and _registry[name].factory is not factory:
            raise ValueError(f"pass {name!r} is registered twice")
        _registry[name] = PassInfo(name, tuple(targets), description, factory)
        return factory

    return decorate


def _load() -> None:
    global _loaded
    if _loaded:
        return
    for package_name in PASS_PACKAGES:
        package = importlib.import_module(package_name)
        for module in pkgutil.iter_modules(package.__path__):
            if not module.name.startswith("_"):
                importlib.import_module(f"{package_name}.{module.name}")
    _loaded = True


def get_pass(name: str) -> PassInfo:
    _load()
    try:
        return _registry[name]
    except KeyError:
        close = difflib.get_close_matches(name, _registry, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise PassError(f"unknown pass {name!r}{hint}; known passes: {', '.join(sorted(_registry))}") from None


def create_pass(name: str) -> ir.passes.PassBase:
    return get_pass(name).factory()


def list_passes(target: str | None = None) -> list[dict[str, object]]:
    """Rows for ``dstc passes list``: name, targets, description; sorted by name.

    With ``target`` (e.g. "openvino"), only passes usable for it: those for that target or for "any".
    """
    if target is not None and target not in TARGETS:
        raise PassError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    _load()
    infos = sorted(_registry.values(), key=lambda info: info.name)
    if target is not None:
        infos = [info for info in infos if target in info.targets or "any" in info.targets]
    return [info.row() for info in infos]
