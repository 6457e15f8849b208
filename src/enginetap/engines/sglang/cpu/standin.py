"""The ``sgl_kernel`` stand-in: what SGLang's CPU path imports from its kernel package.

SGLang imports ``sgl_kernel`` (and names from its submodules) at module load on every
platform, but the registry has CUDA builds of that package only. The stand-in
(``shims/sgl-kernel-cpu``, installed by ``make install-sglang``) is a package whose

- every name, in the package and in any submodule (``sgl_kernel.kvcacheio``,
  ``sgl_kernel.flash_attn``...), is a :class:`Missing` that raises :class:`MissingKernel`
  naming the kernel when called: SGLang's CPU path imports them but, on this path, never
  calls them; a call means a path enginetap does not cover, and says so;
- ``torch.ops.sgl_kernel`` holds only the two ops the CPU path calls unconditionally
  (:func:`~.kernels.register_ops`): every other ``torch.ops.sgl_kernel.X`` stays absent, so
  SGLang's feature probes (``hasattr(torch.ops.sgl_kernel, "fused_qk_norm_cpu")``...) pick
  its torch-native norms, RoPE, MoE and attention;
- ``sgl_kernel.mamba`` is real: the gated-delta and causal-conv kernels in torch.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__all__ = ["Missing", "MissingKernel", "fill_package"]

VERSION = "0.0.0+enginetap.cpu"


class MissingKernel(NotImplementedError):
    """A kernel of SGLang's kernel package was called on the CPU stand-in."""


class Missing:
    """A name of ``sgl_kernel`` that the CPU stand-in does not implement."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise MissingKernel(
            f"{self._name} was called, but this is enginetap's CPU stand-in for sgl_kernel "
            "(no CPU build of SGLang's kernels exists on the registry): this SGLang path is "
            "not covered on the CPU; see docs/sglang.md for the paths that are")

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._name}.{name}")

    def __repr__(self) -> str:
        return f"<enginetap CPU stand-in for {self._name}>"


def _module_getattr(module: str):
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return Missing(f"{module}.{name}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes any ``<root>.<sub>`` without a file of its own a module of Missing names."""

    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(self.root + "."):
            return None  # (last on sys.meta_path: a real file, sgl_kernel.mamba, wins)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package: deeper submodules resolve here too
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def fill_package(name: str) -> None:
    """Turn the package ``name`` (``sgl_kernel``) into the CPU stand-in."""
    import torch

    from enginetap.engines.sglang.cpu.kernels import register_ops

    package = sys.modules[name]
    package.__version__ = VERSION  # type: ignore[attr-defined]
    package.__getattr__ = _module_getattr(name)  # type: ignore[attr-defined]
    package.ENGINETAP_CPU_STANDIN = True  # type: ignore[attr-defined]
    if not any(isinstance(f, _Finder) and f.root == name for f in sys.meta_path):
        sys.meta_path.append(_Finder(name))
    register_ops()
    del torch
