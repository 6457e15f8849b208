"""Where the tap records: wrappers on sublayer classes and on the model's own forward.

Every sublayer class the engine names (:meth:`EngineHooks.sublayer_targets`) gets one
wrapper: it records the output rows under the module's short scope name (``L3.attn.out``,
``L3.moe.gate.out``), and the input rows of decoder layers (``L3.in``; of every sublayer
with ``inputs="all"``). Checkpoints are therefore in execution order: a module's input
before its children, its output after them.

Engines add kernel-level points (KV rows, recurrent state) through their hooks'
:meth:`~enginetap.core.capability.EngineHooks.tap_points`: the built-in engine's ride on
this wrapper (``around=``, :mod:`enginetap.engines.hf.tap`), vLLM's and SGLang's wrap
their kernels.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import torch

from enginetap.core.patching import contained
from enginetap.core.scope import SCOPE
from enginetap.tap.record import TapRecorder, outputs_of

__all__ = ["CheckpointNames", "logits_wrapper", "sublayer_wrapper"]

_LAYER = re.compile(r"^L\d+$")


def _hidden(args: tuple, kwargs: dict) -> Any:
    """The hidden states a module is called with: by name, else the first floating-point
    tensor argument (vLLM's decoder layers take ``positions`` first)."""
    found = kwargs.get("hidden_states")
    if found is not None:
        return found
    for value in (*args, kwargs.get("x")):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    return None


class ModuleNames(tuple):
    """A module's precomputed checkpoint names: ``(base, in, out, kind, is_layer)``."""

    __slots__ = ()


class CheckpointNames:
    """The checkpoint base name of every module of the loaded models: its scope short
    name, plus ``.core`` where a module's short name equals its parent's (vLLM's
    ``self_attn.attn`` kernel layer inside ``self_attn``), so names stay unique. The
    names a call needs are built once per module, not per call (host time per
    checkpoint is what a tap costs)."""

    def __init__(self) -> None:
        self._names: dict[int, ModuleNames] = {}
        """By ``id(module)``: a plain dict lookup per call (a weak-key dictionary makes a
        weak reference per lookup); an entry goes when its module is collected."""

    def add_model(self, model: Any) -> None:
        shorts = {q: SCOPE.short(m) for q, m in model.named_modules()}
        for qualname, module in model.named_modules():
            short = shorts[qualname]
            if short is None:
                continue
            parent = shorts.get(qualname.rpartition(".")[0]) if "." in qualname else None
            base = f"{short}.core" if parent == short else short
            kind = short.rpartition(".")[2]
            key = id(module)
            if key not in self._names:
                weakref.finalize(module, self._names.pop, key, None)
            self._names[key] = ModuleNames((base, f"{base}.in", f"{base}.out", kind,
                                            bool(_LAYER.match(base))))

    def layer_targets(self, model: Any, targets: list[str], kernel_points: bool) -> list[str]:
        """Of ``targets`` (``"module:Class.forward"``), those whose class has a decoder
        layer among ``model``'s modules, or (``kernel_points``) an attention or gated-delta
        module, whose wrapper reads the built-in engine's caches: ``depth="layers"``."""
        wanted = {"attn", "gdn"} if kernel_points else set()
        keep = set()
        for module in model.modules():
            entry = self._names.get(id(module))
            if entry is not None and (entry[4] or entry[3] in wanted):
                cls = type(module)
                keep.add(f"{cls.__module__}:{cls.__qualname__}.forward")
        return [t for t in targets if t in keep]

    def get(self, module: Any) -> str | None:
        found = self._names.get(id(module))
        return None if found is None else found[0]

    def entry(self, module: Any) -> ModuleNames | None:
        return self._names.get(id(module))


def sublayer_wrapper(recorder: TapRecorder, names: CheckpointNames, around: Any = None):
    """The wrapper factory's product for every sublayer target. It runs hundreds of times
    per step, so it contains its own errors (:func:`~enginetap.core.patching.contained`):
    a failure is reported by the recorder and the engine's call goes on unchanged.

    In a quick step (:meth:`~enginetap.tap.record.quick.QuickSteps.start`) it only lists
    each checkpoint's tensor (a tuple of outputs as it is) for the recorder to examine
    after the forward,
    except names in :attr:`TapRecorder.at_call` and kernel-level points.

    ``around``: an engine's points read around the module's forward (its ``before`` and
    ``after`` called with the checkpoint base name, kind, module, hidden states and
    keyword arguments), recorded after the module's input and output."""
    every_input = recorder.options.inputs == "all"
    layers_only = recorder.options.depth == "layers"
    by_id = names._names
    failed = recorder.wrapper_failed
    at_call = recorder.at_call
    compiling = torch.compiler.is_compiling
    cuda = torch.cuda.is_available()

    @contained
    def tap_sublayer(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        entry = by_id.get(id(instance)) if recorder.step is not None else None
        if entry is None:
            return wrapped(*args, **kwargs)
        try:
            name, name_in, name_out, kind, is_layer = entry
            quick = recorder.quick
            if quick is not None:  # where these hold, the checkpoints' own checks refuse
                if compiling():  # traced code: touch nothing
                    quick = None
                elif is_layer and cuda and torch.cuda.is_current_stream_capturing():
                    recorder.settle()  # the step stops being quick
                    quick = None
            hidden = _hidden(args, kwargs) if (every_input or is_layer
                                               or around is not None) else None
            if every_input or is_layer:
                if quick is not None and name_in not in at_call:
                    quick.append((name_in, hidden))
                else:
                    recorder.take(name_in, hidden)
            if around is not None:
                around.before(name, kind, instance, hidden, kwargs)
        except Exception as exc:
            failed(exc)
            return wrapped(*args, **kwargs)
        out = wrapped(*args, **kwargs)
        try:
            if not layers_only or is_layer:  # else wrapped for its kernel points only
                if quick is not None and name_out not in at_call and recorder.quick is quick:
                    quick.append((name_out, out))
                elif isinstance(out, torch.Tensor):
                    recorder.take(name_out, out)
                else:
                    for suffix, tensor in outputs_of(out):
                        recorder.take(f"{name}.{suffix}", tensor)
            if around is not None:
                around.after(name, kind, instance, hidden, kwargs)
        except Exception as exc:
            failed(exc)
        return out

    return tap_sublayer


def _batch_rows(recorder: TapRecorder, hidden: Any) -> torch.Tensor:
    """The batch row of each tapped row, for a ``[batch, columns, ...]`` input."""
    return recorder.index(hidden.device) // int(hidden.shape[1])


def logits_wrapper(recorder: TapRecorder):
    """Wrapper on the model's own ``forward``: top-2 logits of each tapped row's request
    (the last logits row of its batch row, the one the engine samples from)."""

    def tap_logits(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        out = wrapped(*args, **kwargs)
        logits = getattr(out, "logits", None)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if recorder.step is not None and recorder.live and isinstance(logits, torch.Tensor) \
                and logits.dim() == 3 and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            if ids.shape[1] == 1 and len(recorder.token_index) == ids.shape[0]:
                picked = logits[:, -1, :]  # a decode step tapping every row: no gather
            else:
                picked = logits[_batch_rows(recorder, ids), -1, :]
            recorder.note_logits(picked)
        return out

    return tap_logits
