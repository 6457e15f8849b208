"""Helpers every SGLang probe shares."""

from __future__ import annotations

import torch

from enginetap.capture.probe import ProbeCall
from enginetap.definitions import instantiate

__all__ = ["DTYPES", "instantiate", "single_rank"]

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def single_rank(call: ProbeCall) -> None:
    """The SGLang probes describe TP=1 calls (their ``define`` refuses others)."""
    if call.step.world_size != 1:
        raise ValueError("enginetap's SGLang probes capture TP=1 engines only")
