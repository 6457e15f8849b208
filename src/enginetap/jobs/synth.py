"""The synth job: write families' definitions and synthetic workloads into a dataset.

Every family is resolved, and the room all of them need on disk checked, before anything is
written; then each family is synthesized on its own: one that fails leaves nothing behind
and the others still run.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from enginetap.errors import EnginetapError

if TYPE_CHECKING:
    from enginetap.dataset import Dataset
    from enginetap.definitions.base import Template

__all__ = ["SynthOutcome", "synthesize_families"]


@dataclass
class SynthOutcome:
    """One family's result: the definition written, or why it failed."""

    family: str
    definition: str | None = None
    error: str | None = None


def synthesize_families(dataset: Path, families: Sequence[str], overrides: Mapping[str, str],
                        *, workloads: int, seed: int) -> Iterator[SynthOutcome]:
    """Synthesize each of ``families`` (with the ``overrides`` of its const axes and
    params) into ``dataset`` (created if missing), yielding each family's outcome as it
    is done.

    Raises:
        DefinitionError: an unknown family (before anything is written).
        ConfigError: the workloads of all families need more room than the disk has
            (before anything is written).
    """
    from enginetap.dataset import Dataset
    from enginetap.definitions.registry import get_template
    from enginetap.replay.synth import check_room, coerce_values

    target = [get_template(name) for name in families]  # unknown names fail before any write
    store = Dataset(dataset, create=True)
    for template in target:  # more workloads than the disk holds: refused before any write
        try:
            chosen_values = {**template.example, **coerce_values(template, overrides)}
            definition = template.instantiate(**chosen_values)
        except EnginetapError:
            continue  # reported with the family below
        check_room(store, template, definition, workloads)
    for template in target:
        yield _synthesize_one(store, template, overrides, workloads=workloads, seed=seed)


def _synthesize_one(store: Dataset, template: Template, overrides: Mapping[str, str], *,
                    workloads: int, seed: int) -> SynthOutcome:
    from enginetap.replay.synth import coerce_values, synthesize

    try:
        written = synthesize(store, template, coerce_values(template, overrides),
                             workloads=workloads, seed=seed)
    except EnginetapError as exc:
        return SynthOutcome(template.family, error=str(exc))
    except Exception as exc:  # noqa: BLE001 - one family's failure, reported as its outcome
        # Not ours (a full disk, an allocation): one line, and the other families still run.
        return SynthOutcome(template.family, error=f"{type(exc).__name__}: {exc}")
    return SynthOutcome(template.family, definition=written.name)
