"""Traffic: request profiles from real traces, prompts rebuilt from hash blocks, drivers.

``resolve_profile("builtin:mooncake-tiny")`` gives a profile; :class:`PromptBuilder`
turns its hash blocks into token ids; :func:`run_profile` sends it through a driver
(built-in engine, ``vllm.LLM`` or a running ``vllm serve``) and returns one receipt per
request.
"""

from enginetap.traffic.derive import derive_mooncake
from enginetap.traffic.drivers import BuiltinDriver, Driver, HTTPDriver, VLLMDriver
from enginetap.traffic.loaders import MooncakeTrace, load_agentx, load_mooncake
from enginetap.traffic.profile import (
    ArrivalReplay, CachePredecessor, OverlapGroup, RequestProfile, TrafficProfile,
    load_profile, save_profile)
from enginetap.traffic.prompts import PromptBuilder
from enginetap.traffic.runner import Receipt, RunReport, run_profile
from enginetap.traffic.scaling import fit_to_context
from enginetap.traffic.sources import builtin_profile, resolve_profile

__all__ = ["ArrivalReplay", "BuiltinDriver", "CachePredecessor", "Driver", "HTTPDriver",
           "MooncakeTrace", "OverlapGroup", "PromptBuilder", "Receipt", "RequestProfile",
           "RunReport", "TrafficProfile", "VLLMDriver", "builtin_profile", "derive_mooncake",
           "fit_to_context", "load_agentx", "load_mooncake", "load_profile",
           "resolve_profile", "run_profile", "save_profile"]
