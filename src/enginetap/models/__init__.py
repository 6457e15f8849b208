"""Built-in tiny models: real architectures, seeded random weights, a small trained tokenizer.

``build_model("qwen3_next")`` returns a folder that transformers and vLLM load like any
checkpoint; the same name and seed always give the same bytes.
"""

from __future__ import annotations

from enginetap.models.builder import build_model, cache_root, default_model_dir
from enginetap.models.configs import MODEL_NAMES, model_config

__all__ = ["MODEL_NAMES", "build_model", "cache_root", "default_model_dir", "model_config"]
