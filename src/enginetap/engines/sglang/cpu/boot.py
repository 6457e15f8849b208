"""Run at interpreter start in the SGLang venv (``enginetap-sgl-cpu.pth``): torchvision.

SGLang imports ``torchvision`` at module load (``srt/multimodal/internvl_utils.py``), and
the registry's torchvision 0.28 is a CUDA build: beside the CPU torch its import fails
("operator torchvision::nms does not exist") because its compiled ops are not loaded. This
module only puts a finder on ``sys.meta_path`` (no import of torch here): when torchvision
is first imported, the schemas of its two ops that its Python code registers fake kernels
for (``nms``, ``qnms``) are defined first, so it imports; calling them raises torch's own
"no kernel" error. Nothing of torchvision runs on SGLang's text path.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

__all__ = ["install"]

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARY: list[Any] = []  # keeps the torch.library alive


class _TorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        if fullname == "torchvision" and not _LIBRARY:
            _define_schemas()
        return None  # the real finders load it


def _define_schemas() -> None:
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018  (a CPU build of torchvision defines it)
        return
    except (AttributeError, RuntimeError):
        pass
    library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        library.define(schema)
    _LIBRARY.append(library)


def install() -> None:
    if not any(isinstance(f, _TorchvisionOps) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionOps())
