"""Engines over the built-in models, loaded once per test session.

Token-equality tests run in float32: the weights are bf16 on disk (exact in float32), and
float32 keeps batch-shape rounding far below the gaps between the top logits, whereas in
bf16 a random tiny model has near ties that any change of batch shape can flip (also in
transformers' own batched ``generate``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from enginetap.engines.hf import HFEngine

EngineFactory = Callable[..., HFEngine]


@pytest.fixture(scope="session")
def hf_engine() -> EngineFactory:
    """``hf_engine(name, prefix=False)``: a shared float32 engine (prefix cache off by default).

    Tests that depend on prefix-cache state ask for ``prefix=True`` and clear it first.
    """
    engines: dict[tuple[str, bool], HFEngine] = {}

    def get(name: str, prefix: bool = False) -> HFEngine:
        key = (name, prefix)
        if key not in engines:
            engines[key] = HFEngine.from_builtin(name, dtype=torch.float32,
                                                 prefix_cache_size=16 if prefix else 0)
        engine = engines[key]
        engine.prefix_cache.clear()
        return engine

    return get
