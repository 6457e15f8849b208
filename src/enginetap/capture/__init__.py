"""Capture: real operator workloads from engines, canonicalized into FlashInfer-Trace
definitions with a provenance receipt each (see ``docs/capture.md``)."""

from __future__ import annotations

from enginetap.capture.options import POLICIES, CaptureOptions, SelectionPolicy
from enginetap.capture.probe import Extracted, Probe, ProbeCall

__all__ = ["POLICIES", "CaptureOptions", "Extracted", "Probe", "ProbeCall", "SelectionPolicy"]
