"""The tap file format's name and version: what the recorder writes and the readers
check, importable without torch (the analysis side never imports it)."""

from __future__ import annotations

__all__ = ["FORMAT", "RUN_FILE", "VERSION"]

FORMAT = "enginetap-tap"
VERSION = 2
"""2: each checkpoint's hashes are one hex string, 16 digits per tapped row (1 wrote a
list of strings: 64 Python string builds per checkpoint cost more than the tap itself)."""

RUN_FILE = "tap-run.json"
"""What ``enginetap tap run`` was asked (engine, model, prompts, sizes), beside the tap
files: ``enginetap tap report`` builds its next commands from it."""
