"""Helpers every SGLang probe shares."""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import ProbeCall
from enginetap.definitions import instantiate

__all__ = ["CURRENT", "DTYPES", "current_runner", "instantiate", "single_rank"]

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def single_rank(call: ProbeCall) -> None:
    """The SGLang probes describe TP=1 calls (their ``define`` refuses others)."""
    if call.step.world_size != 1:
        raise ValueError("enginetap's SGLang probes capture TP=1 engines only")


CURRENT: list[Any] = [None]
"""Set by the step adapter (:mod:`enginetap.engines.sglang.runner`) around each published
step: here so that the probes read it without importing the engine's runner module."""


def current_runner() -> Any:
    """The model runner whose step is being published (its KV and request pools), else
    None."""
    return CURRENT[0]
