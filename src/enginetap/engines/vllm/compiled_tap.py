"""The tap of a vLLM model that vLLM compiles (its default, not ``enforce_eager``).

vLLM CPU traces the decoder stack once with dynamo in its warm-up run
(``DYNAMO_TRACE_ONCE``: every guard dropped, inductor) and runs that graph for every
later step, never retracing. Dynamo inlines a module's own ``forward`` past the tap's
class-level wrappers, so in the graph nothing of theirs runs. When the model is loaded
(before the warm-up traces it), this module therefore places the tap in the graph:

- every module the eager wrappers name (``L3.attn.out``, ``L3.in``...) inside a
  compiled part of the model gets module hooks, which dynamo traces, calling the
  registered op ``enginetap::tap_hash_rows`` (:mod:`enginetap.tap.record.compiled`) into its
  checkpoint's slot of a per-step buffer; step end reads the buffer once. Hashes and
  names are the eager ones, so ``tap diff`` compares compiled and eager runs;
- the kernel-level points (KV rows, gated-delta states: :mod:`.tap`) run eagerly inside
  vLLM's own custom ops (attention, the GDN core), and their wrappers hash into the same
  buffer, at slots reserved when the module that owns them is traced: a step's
  checkpoints keep the eager execution order.

The graph reads the row index as an input whose shape was traced once: it keeps one size
(``max_rows + 1``; unused entries point at row 0, their hashes are never read). The
hooks stay on the model when the tap is removed: the graph reads the buffer through
them for as long as vLLM runs it (the op then writes into a buffer nobody reads).
vLLM's on-disk compile cache (AOT artifacts) could hand back a graph traced without the
hooks, or with another run's: armed, its use is switched off (``VLLM_DISABLE_COMPILE_CACHE``,
before the warm-up) and the inductor cache, keyed by the graph itself, is kept. A
checkpoint whose hooks were never traced is listed in the header (``not_placed``).
Before the warm-up compiles, :func:`~enginetap.tap.record.inductor.observe_without_changing`
makes inductor give each tap op its own copy of the value it reads, and keeps a dependency
its CPU backend lost: the armed graph computes what the disarmed one does.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

import enginetap.tap.record.compiled  # noqa: F401  (registers enginetap::tap_hash_rows)
from enginetap.tap.record.inductor import observe_without_changing
from enginetap.tap.record.fingerprint import hash_rows
from enginetap.tap.record.points import CheckpointNames, _hidden
from enginetap.tap.record import TapRecorder, outputs_of

__all__ = ["VLLMCompiledTap", "attach_compiled", "compiled_parts"]

logger = logging.getLogger("enginetap.vllm")


def compiled_parts(model: Any) -> tuple[str | None, list[Any]]:
    """vLLM's compilation mode for ``model`` and the modules it compiles with dynamo
    (``@support_torch_compile`` classes with compiling on); ``(None, [])`` when eager."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    parts = [m for m in model.modules() if isinstance(m, TorchCompileWithNoGuardsWrapper)
             and not getattr(m, "do_not_compile", True)]
    if not parts:
        return None, []
    mode = parts[0].compilation_config.mode
    return getattr(mode, "name", str(mode)), parts


def attach_compiled(installed: list[Any], model: Any) -> None:
    """Place every armed tap in ``installed`` into ``model``'s compiled parts (none: the
    eager wrappers record, as they do)."""
    from enginetap.tap.record.arming import TapInstall

    taps = [tap for tap in installed if isinstance(tap, TapInstall)]
    mode, parts = compiled_parts(model) if taps else (None, [])
    if mode is None:
        return
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"  # see the module docstring
    observe_without_changing()
    for tap in taps:
        VLLMCompiledTap(tap.recorder, tap.names, parts, tap.targets, mode).attach()


class VLLMCompiledTap:
    """A compiled vLLM model's checkpoints (see the module docstring): the recorder's
    ``compiled`` (it calls :meth:`begin`, :meth:`collect`, :meth:`detach` and reads
    :attr:`mode` and :attr:`not_placed`)."""

    def __init__(self, recorder: TapRecorder, names: CheckpointNames, parts: list[Any],
                 targets: set[str], mode: str) -> None:
        from enginetap.engines.vllm.tap import kernel_points

        self.recorder, self.mode, self._names = recorder, mode, names
        options = recorder.options
        self.hooked: list[tuple[Any, tuple]] = []
        self.owners: list[tuple[Any, list[str]]] = []
        seen: set[int] = set()
        for module in (m for part in parts for m in part.modules()):
            entry = names.entry(module)
            if entry is None or id(module) in seen:
                continue
            seen.add(id(module))
            cls = type(module)
            if f"{cls.__module__}:{cls.__qualname__}.forward" in targets and (
                    options.depth != "layers" or entry[4]):
                self.hooked.append((module, tuple(entry)))
            points = kernel_points(module, entry[0], entry[3]) if options.continuity else []
            if points:
                self.owners.append((module, points))
        width = options.max_rows + 1
        self.buffer = torch.zeros((4 * len(self.hooked) + 16, width), dtype=torch.int64)
        self.kernel = torch.zeros((sum(len(p) for _, p in self.owners) + 16, width),
                                  dtype=torch.int64)
        """The kernel points' hashes, apart: the graph's write-back of its own buffer at
        its end would drop what eager code wrote into that one meanwhile."""
        self.index = torch.zeros(width, dtype=torch.int64)
        self.slots: dict[str, int] = {}
        """By name: its row of :attr:`buffer` (>= 0) or ``-1 - row`` of :attr:`kernel`."""
        self.order: list[str] = []
        """Every name, in the order first traced (kernel points where reserved)."""
        self.late: list[str] = []
        """Kernel points first met at run time (none reserved for them), in that order."""
        self._handles: list[Any] = []
        self._taken: dict[int, Any] = {}
        self._full = False

    # -- placing ---------------------------------------------------------------------

    def attach(self) -> VLLMCompiledTap:
        """Hook the modules (before vLLM traces them) and become the recorder's."""
        every_input = self.recorder.options.inputs == "all"
        owned = {id(module): points for module, points in self.owners}
        for module, (base, name_in, _, _, is_layer) in self.hooked:
            self._handles.append(module.register_forward_pre_hook(
                self._before(name_in if every_input or is_layer else None,
                             owned.pop(id(module), [])), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._after(base)))
            self._taken[id(module)] = self._names._names.pop(id(module), None)
        for module, points in self.owners:  # owners the eager wrappers do not name
            if id(module) in owned:
                self._handles.append(module.register_forward_pre_hook(
                    self._before(None, points), with_kwargs=True))
        self.recorder.compiled = self
        logger.info("tap: %d modules tapped inside vLLM's compiled model (%s)",
                    len(self.hooked), self.mode)
        return self

    def detach(self) -> None:
        """Leave the recorder; the hooks stay (the compiled graph reads through them)."""
        self._names._names.update((k, e) for k, e in self._taken.items() if e is not None)
        self._taken.clear()
        if self.recorder.compiled is self:
            self.recorder.compiled = None

    def header(self) -> dict[str, Any]:
        """What the tap file's header says of this mode (vLLM's compilation mode; the
        checkpoints not placed), read at the first step."""
        return {"compiled": self.mode, "eager": False, "not_placed": self.not_placed}

    @property
    def not_placed(self) -> list[str]:
        """Checkpoints of tapped modules whose hooks vLLM never traced (read once the
        warm-up compiled the model: at the first step's header)."""
        every_input = self.recorder.options.inputs == "all"
        missing = [n for module, (base, name_in, _, _, is_layer) in self.hooked
                   for n in ([name_in] if every_input or is_layer else []) + [f"{base}.out"]
                   if n not in self.slots]
        return missing + [n for _, points in self.owners for n in points
                          if n not in self.slots]

    def _slot(self, name: str, kernel: bool = False) -> int:
        slot = self.slots.get(name)
        if slot is None:
            used = sum(1 for s in self.slots.values() if (s < 0) == kernel)
            slot = self.slots[name] = -1 - used if kernel else used
            # dynamo replays what traced code did to these lists after every graph call:
            # a name first met at run time goes where that replay does not reach
            (self.order if torch.compiler.is_compiling() else self.late).append(name)
        return slot

    def _hash(self, tensor: Any, name: str) -> None:
        """Traced: the op hashing ``tensor``'s tapped rows into ``name``'s slot."""
        if isinstance(tensor, torch.Tensor):
            torch.ops.enginetap.tap_hash_rows(self.buffer, tensor, self.index, self._slot(name))

    def _before(self, name_in: str | None, points: list[str]) -> Any:
        def tap_input(module: Any, args: tuple, kwargs: dict) -> None:
            if name_in is not None:
                self._hash(_hidden(args, kwargs), name_in)
            for point in points:  # only reserves their places in the order
                self._slot(point, kernel=True)
        return tap_input

    def _after(self, base: str) -> Any:
        def tap_output(module: Any, args: tuple, out: Any) -> None:
            for suffix, tensor in outputs_of(out):
                self._hash(tensor, f"{base}.{suffix}")
        return tap_output

    # -- kernel-level points (eager, inside vLLM's custom ops) -------------------------

    def write_rows(self, name: str, rows: torch.Tensor) -> None:
        """Hash ``rows`` (one per tapped row, gathered) into ``name``'s slot."""
        row = -1 - self._slot(name, kernel=True)
        if row >= self.kernel.shape[0]:
            if not self._full:
                self._full = True
                logger.warning("tap: %s and later kernel points not recorded (more than "
                               "the compiled tap's %d)", name, row)
            return
        flat = rows.detach().reshape(rows.shape[0], -1)
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        hashes = hash_rows(flat)
        self.kernel[row, :hashes.shape[0]] = hashes.to(self.kernel.device)
        self.kernel[row, -1] = 1

    # -- per step (the recorder calls these) -----------------------------------------

    queued = None
    """What the recorder's step end reads of a copy queued at the device wait: never here
    (the buffer is read at step end, :meth:`collect`)."""

    def begin(self, padded: int, token_index: list[int]) -> None:
        """Before the forward: the step's padded token count and tapped rows (their token
        indices) into the index (in place, one size), every slot unwritten."""
        rows = torch.tensor(token_index, dtype=torch.int64)
        self.index.zero_()
        self.index[0] = padded
        self.index[1:1 + rows.numel()] = rows
        self.buffer[:, -1] = 0
        self.kernel[:, -1] = 0

    def collect(self, k: int, queued: Any = None
                ) -> tuple[list[str], torch.Tensor, torch.Tensor | None]:
        """After the forward: the names written this step in execution order, their
        ``[names, k]`` hashes, and no sampler values (``queued`` is always None here:
        the recorder's interface with :class:`~enginetap.tap.record.compiled.CompiledTap`)."""
        both = torch.cat([self.buffer, self.kernel.flip(0)])  # kernel row r at -1 - r
        names = [n for n in self.order + self.late
                 if -len(self.kernel) <= self.slots[n] < len(self.buffer)]
        rows = torch.tensor([self.slots[n] for n in names], dtype=torch.long)
        picked = both.index_select(0, rows.remainder(both.shape[0]))
        written = picked[:, -1].nonzero().flatten()
        return [names[i] for i in written.tolist()], picked[written, :k].contiguous(), None
