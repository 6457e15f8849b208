"""The built-in engine: batched generation over a transformers model, one step at a time.

A thin in-process engine for the quick start and for tests (not a serving engine). It
publishes a step context around every model forward, like enginetap's vLLM adapter.
"""

from __future__ import annotations

from enginetap.engines.hf.arming import arm, disarm
from enginetap.engines.hf.engine import HFEngine
from enginetap.engines.hf.requests import Completion, Request

__all__ = ["Completion", "HFEngine", "Request", "arm", "disarm"]
