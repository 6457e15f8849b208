"""Where to attach inside a transformers model: its sublayer classes' ``forward``.

transformers builds every layer of a kind from one class, so one patch on
``Class.forward`` sees every layer of that kind; patching the class, not the instances,
keeps enginetap from touching the engine's objects.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUBLAYER_SUFFIXES", "sublayer_targets"]

SUBLAYER_SUFFIXES = ("DecoderLayer", "Attention", "RMSNorm", "MoE", "SparseMoeBlock",
                     "GatedDeltaNet", "Experts", "TopkRouter", "Indexer", "MLP")


def sublayer_targets(model: Any) -> list[str]:
    """Targets ``"module:Class.forward"`` for every sublayer class used in ``model``, sorted."""
    classes = {type(m) for m in model.modules() if type(m).__name__.endswith(SUBLAYER_SUFFIXES)}
    return sorted(f"{c.__module__}:{c.__qualname__}.forward" for c in classes)
