"""``python -m enginetap.engines.sglang.probes``: the targets the SGLang capture drift lock
pins, one a line (what ``enginetap guard pin`` takes)."""

from enginetap.engines.sglang.probes import LOCK

LOCK.print_targets()
