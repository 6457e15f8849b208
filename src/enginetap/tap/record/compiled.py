"""Checkpoints that torch.compile traces and CUDA graphs replay: registered ops hashing
tapped rows on the device.

Under torch.compile the tap's class-level wrappers (wrapt) are not traced into the graph:
dynamo inlines a submodule's original ``forward`` past them, and where that forward is
itself a closure (transformers' MoE experts) dynamo's guard on the wrapper's closure
fails on the frame that made it. While this tap is attached, the tap's class patches of
the model's sublayer classes are therefore taken off (put back at :meth:`detach`), and
the model is tapped through module hooks, which dynamo does trace, each calling
``enginetap::tap_hash_rows``: a custom op (its write into the tap buffer declared, so
the compiler keeps it in place and in order) that hashes the tapped rows of the
sublayer output into its checkpoint's slot of a per-step buffer ``[slots, rows + 1]``
(the last column flags the slots written this step). The hash is
:func:`~enginetap.tap.record.fingerprint.hash_rows` on the rows :func:`token_rows` gives the
eager path, so records of eager and compiled runs diff against each other; step end
brings the buffer to the host once.

Under CUDA graphs (the built-in engine's ``mode="graphs"``) the same hooks call
``enginetap::tap_hash_rows_fixed`` instead: the padded row count is a constant of the
captured shape and the tapped rows' index tensor is one static tensor per captured batch
size (:meth:`CompiledTap.capturing`), refilled in place before each replay, so a replay
does no host work per checkpoint. On CUDA the gather and hash are one Triton launch per
decoder layer (:mod:`enginetap.tap.record.rowhash`): a layer's checkpoints are held until
its output (or the decoder's) and hashed together (:meth:`CompiledTap.flush`), through a
table of their addresses that a captured graph reads from a device tensor filled once the
capture is over (the addresses of a graph's tensors are those of every replay). Index
entries past the step's tapped rows repeat its first row and are never read back: padding
rows are never recorded.

Kernel-level points (KV rows, recurrent state around the step) are read by the eager
wrappers from the engine's cache objects: they are not placed in these modes, and the
header says which (``not_placed``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from enginetap.tap.record.fingerprint import _weights_from, _words, token_rows
from enginetap.tap.record.points import CheckpointNames, _hidden
from enginetap.tap.record import TapRecorder, outputs_of
from enginetap.tap.record import rowhash
from enginetap.tap.record.rowhash import fused_hash

if TYPE_CHECKING:
    from enginetap.tap.record.arming import TapInstall

__all__ = ["CompiledTap", "Queued", "tap_hash_rows", "tap_hash_rows_fixed"]

logger = logging.getLogger("enginetap.tap")


def _hash_into(buffer: torch.Tensor, rows: torch.Tensor | None, index: torch.Tensor,
               slot: int) -> None:
    """Hash ``rows[index]`` into ``buffer[slot]`` and flag the slot written."""
    if rows is None or fused_hash(buffer, rows, index, slot):
        return
    picked = rows.index_select(0, index.to(rows.device))
    words = _words(picked.contiguous())
    hashes = (words * _weights_from(0, words.shape[1], words.device)).sum(dim=1)
    buffer[slot, :hashes.shape[0]] = hashes.to(buffer.device)
    buffer[slot, -1] = 1


@torch.library.custom_op("enginetap::tap_hash_rows", mutates_args=("buffer",))
def tap_hash_rows(buffer: torch.Tensor, tensor: torch.Tensor, index: torch.Tensor,
                  slot: int) -> None:
    """Hash the tapped rows of ``tensor`` into ``buffer[slot]``. ``index`` is the step's
    padded token count followed by the tapped rows' token indices; a tensor whose
    leading dims are not the step's token rows writes nothing (its flag stays 0)."""
    if slot >= buffer.shape[0] or index.numel() < 2:
        return
    _hash_into(buffer, token_rows(tensor.detach(), int(index[0])), index[1:], slot)


@tap_hash_rows.register_fake
def _tap_hash_rows_fake(buffer: torch.Tensor, tensor: torch.Tensor, index: torch.Tensor,
                        slot: int) -> None:
    return None


@torch.library.custom_op("enginetap::tap_hash_rows_fixed", mutates_args=("buffer",))
def tap_hash_rows_fixed(buffer: torch.Tensor, tensor: torch.Tensor, index: torch.Tensor,
                        slot: int, padded: int) -> None:
    """:func:`tap_hash_rows` for a shape fixed when captured: ``padded`` token rows,
    ``index`` only the tapped rows' token indices (no host read: graph-capturable)."""
    if slot >= buffer.shape[0] or index.numel() < 1:
        return
    _hash_into(buffer, token_rows(tensor.detach(), padded), index, slot)


@tap_hash_rows_fixed.register_fake
def _tap_hash_rows_fixed_fake(buffer: torch.Tensor, tensor: torch.Tensor,
                              index: torch.Tensor, slot: int, padded: int) -> None:
    return None


class CompiledTap:
    """The compiled (or graph-captured) engine's checkpoints: module hooks calling the
    ops above, one slot per checkpoint name (assigned when first traced or run, in
    execution order). ``mode``: ``"torch.compile"`` or ``"cuda graphs"``.

    While attached, the model's modules are taken out of the eager wrappers' names and
    the tap's patches on their classes are off (no checkpoint is recorded twice, none
    refused at trace time, no wrapper for dynamo to guard on)."""

    def __init__(self, installed: TapInstall, model: Any, device: torch.device,
                 mode: str = "torch.compile") -> None:
        self.recorder: TapRecorder = installed.recorder
        self.mode = mode
        self._installed = installed
        options = self.recorder.options
        self.modules: list[tuple[Any, tuple]] = []
        self.not_placed: list[str] = []
        self._classes: set[str] = set()
        for module in model.modules():
            entry = installed.names.entry(module)
            cls = type(module)
            target = f"{cls.__module__}:{cls.__qualname__}.forward"
            if entry is None or target not in installed.targets:
                continue
            self._classes.add(target)
            base, _, _, kind, is_layer = entry
            if options.depth == "layers" and not is_layer:
                continue
            self.modules.append((module, tuple(entry)))
            if options.continuity and kind == "attn" and hasattr(module, "layer_idx"):
                self.not_placed += [f"{base}.kv_written", f"{base}.kv_prev"]
            elif options.continuity and kind == "gdn":
                self.not_placed += [f"{base}.{p}_{w}" for p in ("state", "conv")
                                    for w in ("before", "after")]
        capacity = 4 * len(self.modules) + 8
        self.buffer = torch.zeros((capacity, options.max_rows + 1), dtype=torch.int64,
                                  device=device)
        self.index = torch.zeros(2, dtype=torch.int64, device=device)
        self.padded = 0
        """The step's padded token rows (the fixed op's; a captured shape's at capture)."""
        self.static: dict[int, torch.Tensor] = {}
        """By captured padded row count: the tapped rows' index tensor its graph reads."""
        self.slots: dict[str, int] = {}
        self.order: list[str] = []
        self._handles: list[Any] = []
        self._names = installed.names
        self._taken: dict[int, Any] = {}
        self._off: list[str] = []
        self.alias: dict[int, int] = {}
        """Graphs mode: slot -> the slot whose hashes it repeats (see :meth:`_hash`)."""
        self._last: tuple[Any, int] = (None, -1)
        self._model = model
        self.pending: list[tuple[torch.Tensor, int]] = []
        """Graphs mode: the current layer's checkpoints (rows, slot) not hashed yet."""
        self.tables: dict[int, torch.Tensor] = {}
        """Graphs mode, by captured padded row count: the device table its graph's
        per-layer launches read (see :meth:`flush`)."""
        self._captured: list[list[int]] = []
        """The table entries of the graph being captured, in launch order."""
        self._filled: dict[int, list[int]] = {}
        """Graphs mode, by captured padded row count: the rows its static index holds."""
        self._alias_index: tuple[dict[int, int], Any, Any] = ({}, None, None)
        """:attr:`alias` as index tensors (made again when it changes)."""
        self.queued: Queued | None = None
        """The step's buffer and sampler values on their way to the host (:meth:`queue`)."""
        self._zeroed = False
        """The buffer was zeroed behind the last queued copy and nothing wrote it since
        (the next step's begin launches no zeroing)."""

    def header(self) -> dict[str, Any]:
        """What the tap file's header says of this mode."""
        return {"compiled": self.mode, "cuda_graphs": self.mode == "cuda graphs",
                "eager": False, "not_placed": self.not_placed}

    def attach(self, head: Any = None) -> CompiledTap:
        """Hook the modules; ``head`` (graphs: the LM head, run eagerly after a replay)
        gets a hook recording the sampler's logits of replayed steps."""
        options = self.recorder.options
        for module, entry in self.modules:
            _, name_in, name_out, _, is_layer = entry
            if options.inputs == "all" or is_layer:
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_hook(name_in), with_kwargs=True))
            if options.depth != "layers" or is_layer:
                self._handles.append(module.register_forward_hook(
                    self._hook(entry[0], is_layer and self.mode == "cuda graphs")))
            key = id(module)
            self._taken[key] = self._names._names.pop(key, None)
        if head is not None:
            self._handles.append(head.register_forward_hook(self._head_hook))
        if self.mode == "cuda graphs":  # the last layer's pending checkpoints, in the graph
            self._handles.append(self._model.register_forward_hook(self._flush_hook))
        if self.mode == "torch.compile":
            from enginetap.tap.record.inductor import observe_without_changing

            observe_without_changing()  # an inductor graph tapped computes what it did untapped
        self._take_patches_off()
        self.recorder.compiled = self
        return self

    def _take_patches_off(self) -> None:
        patches = self._installed.patches.patches
        off = [p for p in patches if str(p.target) in self._classes]
        for patch in off:
            patch.uninstall()
            patches.remove(patch)
        self._off = [str(p.target) for p in off]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for key, entry in self._taken.items():
            if entry is not None:
                self._names._names[key] = entry
        self._taken.clear()
        installed = self._installed
        if self._off and any(p.installed for p in installed.patches.patches):
            from enginetap.tap.record.points import sublayer_wrapper  # the tap is still on

            installed.patches.install_more(
                (t, sublayer_wrapper(self.recorder, self._names)) for t in self._off)
        self._off = []
        if self.recorder.compiled is self:
            self.recorder.compiled = None

    def _slot(self, name: str) -> int:
        slot = self.slots.get(name)
        if slot is None:
            slot = self.slots[name] = len(self.order)
            self.order.append(name)
            if slot >= self.buffer.shape[0]:
                logger.warning("tap: %s not placed under %s (more checkpoints than the "
                               "buffer's %d slots)", name, self.mode, self.buffer.shape[0])
        return slot

    def _hash(self, tensor: torch.Tensor, name: str) -> None:
        if self.mode == "torch.compile":
            torch.ops.enginetap.tap_hash_rows(self.buffer, tensor, self.index, self._slot(name))
            return
        if not self.padded:
            return
        slot = self._slot(name)
        if tensor is self._last[0]:
            # The very tensor the last checkpoint hashed, nothing run in between (a
            # layer's output is the next layer's input): its hashes are copied at collect.
            self.alias[slot] = self._last[1]
            return
        self.alias.pop(slot, None)
        self._last = (tensor, slot)
        rows = token_rows(tensor.detach(), self.padded)
        if rows is not None and slot < self.buffer.shape[0] and self.index.numel() \
                and rowhash.fusable(rows):
            self.pending.append((rows, slot))
            return
        torch.ops.enginetap.tap_hash_rows_fixed(self.buffer, tensor, self.index, slot,
                                                self.padded)

    def flush(self) -> None:
        """Graphs mode: hash the checkpoints held since the last flush in one launch (a
        decoder layer's, at its output). Under capture the launch reads its entries from
        this shape's device table, filled when the capture is over (:meth:`capturing`);
        elsewhere from a table copied for this launch."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        entries = [rowhash.entry(rows, slot) for rows, slot in pending]
        widest = max(e[2] for e in entries)
        if torch.cuda.is_current_stream_capturing():
            table = self.tables[self.padded]
            start = len(self._captured)
            self._captured += entries
            view = table[start:start + len(entries)]
        else:
            view = torch.tensor(entries, dtype=torch.int64).to(self.buffer.device,
                                                               non_blocking=True)
        rowhash.hash_slots(self.buffer, view, len(entries), self.index, widest)

    def _flush_hook(self, module: Any, args: tuple, out: Any) -> None:
        self.flush()

    def _pre_hook(self, name: str) -> Any:
        def tap_input(module: Any, args: tuple, kwargs: dict) -> None:
            hidden = _hidden(args, kwargs)
            if isinstance(hidden, torch.Tensor):
                self._hash(hidden, name)
        return tap_input

    def _hook(self, base: str, is_layer: bool = False) -> Any:
        def tap_output(module: Any, args: tuple, out: Any) -> None:
            for suffix, tensor in outputs_of(out):
                if isinstance(tensor, torch.Tensor):
                    self._hash(tensor, f"{base}.{suffix}")
            if is_layer and self.pending:
                self.flush()
        return tap_output

    def _head_hook(self, module: Any, args: tuple, out: Any) -> None:
        step = self.recorder.step
        if step is not None and step.extra.get("cuda_graph") and isinstance(out, torch.Tensor):
            rows = self.index[:len(self.recorder.rows)]
            self.recorder.note_logits(out[:, -1, :].index_select(0, rows))

    # -- per step (the recorder and the graph runner call these) -----------------------

    def capturing(self, padded: int | None) -> None:
        """A CUDA graph of ``padded`` token rows is about to be captured (None: capture
        over): its hooks read that shape's static index tensor."""
        self._last = (None, -1)
        self._zeroed = False  # a capture's warm-up run writes the buffer
        if padded is None:
            if self._captured:  # the capture is over: its launches' table, once
                table = self.tables[self.padded]
                table[:len(self._captured)].copy_(torch.tensor(self._captured,
                                                               dtype=torch.int64))
            self._captured, self.pending = [], []
            self.padded = 0
            return
        self._captured, self.pending = [], []
        self.tables[padded] = torch.zeros((self.buffer.shape[0], rowhash.ENTRY),
                                          dtype=torch.int64, device=self.buffer.device)
        size = min(padded, self.recorder.options.max_rows)
        index = self.static.get(padded)
        if index is None:
            index = self.static[padded] = torch.zeros(size, dtype=torch.int64,
                                                      device=self.buffer.device)
            self._filled.pop(padded, None)
        self.index, self.padded = index, padded

    def begin(self, padded: int, token_index: list[int]) -> None:
        """Before the forward: the step's tapped rows (their token indices), and every
        slot unwritten. The index tensor is refilled in place where its size allows (the
        compiled graph reads it as an input; a captured graph, the static tensor of its
        shape, refilled only when the rows changed: a batch's decode steps keep them)."""
        if not self._zeroed:  # flags unwritten; the fused kernel adds into its slots
            self.buffer.zero_()
        self._zeroed = False
        self.queued = None
        self._last = (None, -1)
        static = self.static.get(padded) if self.mode == "cuda graphs" else None
        if static is not None:
            rows = token_index[:static.numel()]
            rows = rows + rows[:1] * (static.numel() - len(rows))
            if self._filled.get(padded) != rows:
                static.copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)
                self._filled[padded] = rows
            self.index, self.padded = static, padded
            return
        values = torch.tensor(token_index, dtype=torch.int64)
        self.padded = padded
        if self.mode != "torch.compile":  # an eager step of the graphs mode: a fresh one
            self.index = values.to(self.buffer.device)
            return
        values = torch.cat([torch.tensor([padded], dtype=torch.int64), values])
        if self.index.numel() == values.numel():
            self.index.copy_(values)
        else:
            self.index = values.to(self.buffer.device)

    def queue(self, extra: list[torch.Tensor]) -> None:
        """At the device wait of a step on CUDA (its replay or compiled forward and the
        sampler's top-2 queued, the host about to block for the sampled tokens): queue the
        buffer and ``extra`` (the sampler's values, int64) into pinned host memory behind
        them, then zero the buffer for the next step. Step end then reads values that have
        landed, and the next step's begin launches nothing: no transfer, wait or launch of
        the tap's is left between the engine's sampling and its next replay."""
        n = min(len(self.order), self.buffer.shape[0])
        flat = torch.cat([self.buffer[:n].flatten(), *extra])
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.buffer.device))
        self.buffer.zero_()
        self._zeroed = True
        self.queued = Queued(event, host, self.order[:n], self._alias_tensors(), len(extra))

    def collect(self, k: int, queued: Queued | None = None
                ) -> tuple[list[str], torch.Tensor, torch.Tensor | None]:
        """After the forward: the names written this step in execution order, their
        ``[names, k]`` hashes on the host, and the sampler values queued with them
        (``queued``, from :meth:`queue`; None: the buffer is read now, no sampler values)."""
        if queued is None:
            n = min(len(self.order), self.buffer.shape[0])
            names, hashes = _written(self.buffer[:n].cpu(), self.order[:n],
                                     self._alias_tensors(), k)
            return names, hashes, None
        queued.event.synchronize()
        width, n = self.buffer.shape[1], len(queued.order)
        table = queued.host[:n * width].view(n, width)
        names, hashes = _written(table, queued.order, queued.alias, k)
        return names, hashes, queued.host[n * width:]

    def _alias_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:attr:`alias` as (slots, their sources) index tensors, None without aliases
        (indexing by a list of ints costs milliseconds)."""
        if not self.alias:
            return None
        if self._alias_index[0] != self.alias:
            self._alias_index = (dict(self.alias), torch.tensor(list(self.alias)),
                                 torch.tensor(list(self.alias.values())))
        return self._alias_index[1], self._alias_index[2]


class Queued(NamedTuple):
    """A step's buffer and sampler values queued to the host (:meth:`CompiledTap.queue`):
    the copy's event, the pinned tensor (buffer rows, then the sampler's words), the
    names of the buffer's slots then, its aliases, and how many sampler tensors follow."""

    event: Any
    host: torch.Tensor
    order: list[str]
    alias: tuple[torch.Tensor, torch.Tensor] | None
    extras: int


def _written(host: torch.Tensor, order: list[str],
             alias: tuple[torch.Tensor, torch.Tensor] | None, k: int
             ) -> tuple[list[str], torch.Tensor]:
    """Of a host copy of the buffer's slots (``order``'s names): the names written this
    step in execution order and their ``[names, k]`` hashes, the aliased slots' copied
    from the slots they repeat."""
    if alias is not None:  # (out of place: a copy made in inference mode is read outside)
        to, source = alias
        host = host.index_copy(0, to, host.index_select(0, source))
    flags = host[:, -1]
    if bool(flags.all()):  # every slot written (the usual step): no selection
        return list(order), host[:, :k].contiguous()
    written = flags.nonzero().flatten()
    return ([order[i] for i in written.tolist()],
            host.index_select(0, written)[:, :k].contiguous())
