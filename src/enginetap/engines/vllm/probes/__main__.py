"""``python -m enginetap.engines.vllm.probes``: the targets the vLLM capture drift lock
pins, one a line (what ``enginetap guard pin`` takes)."""

from enginetap.engines.vllm.probes import LOCK

LOCK.print_targets()
