"""Where to attach inside a transformers model: its sublayer classes' ``forward``.

transformers builds every layer of a kind from one class, so one patch on
``Class.forward`` sees every layer of that kind; patching the class, not the instances,
keeps enginetap from touching the engine's objects. The classes are named by suffix
(data), resolved by :func:`enginetap.core.scope.sublayer_targets`.
"""

from __future__ import annotations

from typing import Any

from enginetap.core.scope import SublayerSpec
from enginetap.core.scope import sublayer_targets as _resolve

__all__ = ["SUBLAYERS", "SUBLAYER_SUFFIXES", "sublayer_targets"]

SUBLAYER_SUFFIXES = ("DecoderLayer", "Attention", "RMSNorm", "MoE", "SparseMoeBlock",
                     "GatedDeltaNet", "Experts", "TopkRouter", "TopKRouter", "Indexer", "MLP")
SUBLAYERS = SublayerSpec(suffixes=SUBLAYER_SUFFIXES)


def sublayer_targets(model: Any) -> list[str]:
    """Targets ``"module:Class.forward"`` for every sublayer class used in ``model``, sorted."""
    return _resolve(model, SUBLAYERS)
