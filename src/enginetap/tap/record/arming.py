"""The ``tap`` capability: a :class:`TapRecorder` and its wrappers in an armed process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from enginetap.core.capability import ArmContext, InstallResult
from enginetap.core.patching import PatchSet
from enginetap.core.scope import ScopeUse
from enginetap.tap.options import TapOptions
from enginetap.tap.record.points import CheckpointNames, logits_wrapper, sublayer_wrapper
from enginetap.tap.record import TapRecorder

__all__ = ["TapInstall", "install"]


@dataclass
class TapInstall:
    """What ``tap`` installed: the recorder and one wrapper per sublayer class."""

    recorder: TapRecorder
    patches: PatchSet = field(default_factory=lambda: PatchSet("tap"))
    targets: set[str] = field(default_factory=set)
    names: CheckpointNames = field(default_factory=CheckpointNames)

    def add_model(self, model: Any, targets: list[str],
                  points: Sequence[tuple[str, Callable[..., Any]]] = ()) -> None:
        """Wrap ``model``'s sublayer classes (once per class), its own forward and the
        engine's kernel-level ``points`` (``(target, factory(recorder, names))``)."""
        self.recorder.model_loaded(model)
        self.names.add_model(model)
        if self.recorder.options.depth == "layers":
            kept = self.names.layer_targets(model, targets,
                                            kernel_points=self.recorder.options.continuity)
            # a point riding on a sublayer wrapper goes where that wrapper goes
            points = [(t, f) for t, f in points if t in kept or t not in targets]
            targets = kept
        cls = type(model)
        own = f"{cls.__module__}:{cls.__qualname__}.forward"
        factories: dict[str, Callable[..., Any]] = dict.fromkeys(targets, sublayer_wrapper)
        factories[own] = lambda recorder, _: logits_wrapper(recorder)
        factories.update(points)
        new = [t for t in factories if t not in self.targets]
        self.targets.update(new)
        self.patches.install_more((t, factories[t](self.recorder, self.names)) for t in new)

    def uninstall(self) -> None:
        self.patches.uninstall()
        self.targets.clear()
        self.recorder.uninstall()


def install(context: ArmContext) -> InstallResult:
    """Record per-step row fingerprints to ``<out_dir>/<file>-rank<r>.jsonl``.

    Raises:
        PatchError: a sublayer target of a loaded model does not resolve.
    """
    options = context.options_of("tap")
    assert isinstance(options, TapOptions)
    scope = context.notes.get("scope")
    if isinstance(scope, ScopeUse):
        # The tap takes module names from the scope's registry and never reads the
        # running sublayer (armed without capture, the scope installs no wrapper): the
        # scope's wrappers need not run for it, only for capture.
        scope.part_time("tap")
    installed = TapInstall(TapRecorder(context, options).install())
    context.hooks.on_model_loaded(
        lambda model: installed.add_model(model, context.hooks.sublayer_targets(model),
                                          context.hooks.tap_points(model)))
    context.notes["tap"] = installed.recorder
    return installed, (f"tap (up to {options.max_rows} rows per step, writing to "
                       f"{installed.recorder.writer.path})")
