"""Selection: which steps are captured, and which calls of a selected step become
workloads.

A step is selected when it has prefill rows (and the policy captures prefill) or when one
of its requests is at a selected decode step: decode steps are counted per request key,
0 for the first step after its prefill. ``middle`` and ``last`` are resolved from the
request's expected output length (its label); a request without one gets only the numbered
picks. Per step the decision is made once, at the step's beginning, so a probe's check on
an unselected step is one attribute read and nothing is copied.

Within a selected step every definition keeps at most ``per_variant`` workloads per
variant — (mode, token-count bucket, cached prefix or not, batch size bucket[, layer]) —
and at most ``per_definition`` in all.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from enginetap.capture.labels import RequestLabels
from enginetap.capture.options import SelectionPolicy
from enginetap.core.context import Step

__all__ = ["Selector", "Variant"]

Variant = tuple[str, int, bool, int, str]


def _bucket(n: int) -> int:
    """The power of two at or above ``n`` (1, 2, 4, 8, ...)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class Selector:
    policy: SelectionPolicy
    labels: RequestLabels
    decode_index: Counter = field(default_factory=Counter)
    selected_step: int | None = None
    claimed: Counter = field(default_factory=Counter)
    per_definition: Counter = field(default_factory=Counter)
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        picks = self.policy.decode_steps
        self._numbered = frozenset(p for p in picks if isinstance(p, int))
        self._middle, self._last = "middle" in picks, "last" in picks
        self._by_label: dict[str, frozenset[int]] = {}
        """Per request key with a label, its ``middle``/``last`` decode indices."""
        self._keys: tuple[Step | None, list[str]] = (None, [])
        """The step whose decoding request keys were last listed, and that list (made
        once per step: at its beginning, reused at its end)."""

    def on_begin(self, step: Step) -> None:
        """Decide whether ``step`` is selected (a step listener). Runs on every step, so
        it is a few C-level lookups per request; the labels file is looked at only while
        a request of the step has no label yet."""
        self.selected_step = step.step if self._wanted(step) else None
        if self.selected_step is None:
            self.skipped_steps += 1

    def on_end(self, step: Step) -> None:
        self.decode_index.update(self._keys_of(step))  # each key once: +1 each
        self._keys = (None, [])

    def selected(self, step: Step) -> bool:
        return self.selected_step == step.step

    def _wanted(self, step: Step) -> bool:
        if step.mode != "decode" and self.policy.prefill:
            return True
        keys = self._keys_of(step)
        at = list(map(self.decode_index.__getitem__, keys))
        if not self._numbered.isdisjoint(at):
            return True
        if not (self._middle or self._last):
            return False
        by_label = self._by_label
        if not by_label.keys() >= set(keys):
            self.labels.refresh()
            for key in keys:
                if key not in by_label:
                    picks = self._label_picks(key)
                    if picks is not None:
                        by_label[key] = picks
        return any(i in by_label.get(key, ()) for key, i in zip(keys, at))

    def _keys_of(self, step: Step) -> list[str]:
        if self._keys[0] is not step:
            self._keys = (step, self._decode_keys(step))
        return self._keys[1]

    def _decode_keys(self, step: Step) -> list[str]:
        """Keys of the requests decoding in ``step`` (a mixed step names its prefills)."""
        keys = list(dict.fromkeys(step.rows.keys))
        if step.mode == "decode":
            return keys
        if step.mode == "prefill":
            return []
        prefilling = set(step.extra.get("prefill_requests", ()))
        ids = dict(zip(step.rows.keys, step.rows.request_ids))
        return [k for k in keys if ids[k] not in prefilling]

    def _label_picks(self, key: str) -> frozenset[int] | None:
        """``key``'s middle/last decode indices from its label's expected output length;
        None while it has no label (looked for again next step)."""
        label = self.labels.peek(key)
        if not label:
            return None
        output = label.get("output_tokens")
        if not isinstance(output, int) or output < 2:
            return frozenset()
        decodes = output - 1  # the first output token comes from the prefill step
        picks = set()
        if self._middle:
            picks.add((decodes - 1) // 2)
        if self._last:
            picks.add(decodes - 1)
        return frozenset(picks)

    def variant(self, step: Step, layer: str) -> Variant:
        rows = step.rows
        cached = step.mode != "decode" and any(c > 0 for c in rows.computed_host)
        requests = len(set(rows.keys))
        return (step.mode, _bucket(len(rows)), cached, _bucket(requests),
                layer if self.policy.per_layer else "")

    def claim(self, definition: str, variant: Variant) -> bool:
        """Reserve a workload slot for ``definition`` × ``variant``; False when full."""
        key = (definition, variant)
        if (self.claimed[key] >= self.policy.per_variant
                or self.per_definition[definition] >= self.policy.per_definition):
            return False
        self.claimed[key] += 1
        self.per_definition[definition] += 1
        return True

    def release(self, definition: str, variant: Variant) -> None:
        """Give a claimed slot back (the call could not be captured after all)."""
        self.claimed[(definition, variant)] -= 1
        self.per_definition[definition] -= 1
