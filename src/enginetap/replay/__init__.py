"""Replay a dataset's workloads through references and candidate solutions, and compare."""

from enginetap.replay.compare import Comparison, compare_outputs
from enginetap.replay.results import ReplayReport
from enginetap.replay.runner import replay_dataset
from enginetap.replay.solution import implements

__all__ = ["Comparison", "ReplayReport", "compare_outputs", "implements", "replay_dataset"]
