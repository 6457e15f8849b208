"""Seeded random weights for the built-in models, written in the checkpoint layout.

The tensor names and shapes are the ones transformers writes for the architecture (per
expert weights, not its in-memory fused layout), so vLLM loads the same file. Values come
from one ``torch.Generator`` drawing every tensor in sorted-name order, so the bytes depend
only on the names, shapes and seed, never on transformers' own initialisation (which
leaves some tensors at zero and would make the models trivial).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["checkpoint_layout", "draw_weights", "STD"]

STD = 0.02
"""Standard deviation of matrices and embeddings."""


def checkpoint_layout(config_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape as transformers saves the model whose ``config.json`` is here.

    The model is built once with transformers' own init and saved to a scratch folder;
    only the safetensors header (names, shapes) is kept.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory(dir=config_dir) as scratch:
            model.save_pretrained(scratch)
            with safe_open(Path(scratch) / "model.safetensors", "pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _draw(name: str, shape: tuple[int, ...], config: dict[str, Any],
          gen: torch.Generator) -> torch.Tensor:
    """One tensor's values; the kind of parameter decides the distribution."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        # Decay rates spread over [1, 16] like trained GDN layers: stable state, real decay.
        u = torch.rand(shape, generator=gen, dtype=torch.float32)
        return torch.log(1.0 + 15.0 * u)
    if leaf == "dt_bias":
        return 1.0 + 0.1 * noise
    if leaf == "e_score_correction_bias":
        # Large enough to move some routing decisions, small next to the sigmoid scores.
        return 0.05 * noise
    if name.endswith("norm.weight"):
        # Qwen3-Next scales by (1 + weight) except in its gated norm; others by weight.
        zero_centered = config["model_type"] == "qwen3_next" and "linear_attn" not in name
        return (0.0 if zero_centered else 1.0) + STD * noise
    if leaf == "bias":
        return STD * noise
    if "conv1d" in name:
        # A short depthwise kernel: N(0, 0.02) would all but erase the mixed signal.
        return noise / math.sqrt(shape[-1])
    return STD * noise


def draw_weights(layout: dict[str, tuple[int, ...]], config: dict[str, Any],
                 seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``layout``, drawn in sorted-name order from one seeded generator."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return {
        name: _draw(name, layout[name], config, gen).to(torch.bfloat16).contiguous()
        for name in sorted(layout)
    }
