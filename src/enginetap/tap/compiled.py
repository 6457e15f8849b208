"""Checkpoints that torch.compile traces: a registered op hashing tapped rows in the graph.

Under torch.compile the tap's class-level wrappers (wrapt) are not traced into the graph:
dynamo inlines a submodule's original ``forward`` past them. A compiled engine is
therefore tapped through module hooks, which dynamo does trace, each calling
``enginetap::tap_hash_rows``: a custom op (its write into the tap buffer declared, so
the compiler keeps it in place and in order) that hashes the tapped rows of the
sublayer output into its checkpoint's slot of a per-step buffer ``[slots, rows + 1]``
(the last column flags the slots written this step). The hash is
:func:`~enginetap.tap.fingerprint.hash_rows` on the rows :func:`token_rows` gives the
eager path, so records of eager and compiled runs diff against each other; step end
brings the buffer to the host once.

Kernel-level points (KV rows, recurrent state around the step) are read by the eager
wrappers from the engine's cache objects: they are not placed under compile, and the
header says which (``not_placed``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from enginetap.tap.fingerprint import _weights_from, _words, token_rows
from enginetap.tap.points import CheckpointNames, _hidden
from enginetap.tap.recorder import TapRecorder, outputs_of

__all__ = ["CompiledTap", "tap_hash_rows"]

logger = logging.getLogger("enginetap.tap")


@torch.library.custom_op("enginetap::tap_hash_rows", mutates_args=("buffer",))
def tap_hash_rows(buffer: torch.Tensor, tensor: torch.Tensor, index: torch.Tensor,
                  slot: int) -> None:
    """Hash the tapped rows of ``tensor`` into ``buffer[slot]``. ``index`` is the step's
    padded token count followed by the tapped rows' token indices; a tensor whose
    leading dims are not the step's token rows writes nothing (its flag stays 0)."""
    if slot >= buffer.shape[0] or index.numel() < 2:
        return
    padded = int(index[0])
    rows = token_rows(tensor.detach(), padded)
    if rows is None:
        return
    picked = rows.index_select(0, index[1:].to(rows.device))
    words = _words(picked.contiguous())
    hashes = (words * _weights_from(0, words.shape[1], words.device)).sum(dim=1)
    buffer[slot, :hashes.shape[0]] = hashes.to(buffer.device)
    buffer[slot, -1] = 1


@tap_hash_rows.register_fake
def _tap_hash_rows_fake(buffer: torch.Tensor, tensor: torch.Tensor, index: torch.Tensor,
                        slot: int) -> None:
    return None


class CompiledTap:
    """The compiled engine's checkpoints: module hooks calling :func:`tap_hash_rows`,
    one slot per checkpoint name (assigned when first traced, in execution order).

    While attached, the model's modules are taken out of the eager wrappers' names (they
    pass through: no checkpoint is recorded twice, none refused at trace time)."""

    def __init__(self, recorder: TapRecorder, names: CheckpointNames, model: Any,
                 targets: set[str], device: torch.device) -> None:
        self.recorder = recorder
        options = recorder.options
        self.modules: list[tuple[Any, tuple]] = []
        self.not_placed: list[str] = []
        for module in model.modules():
            entry = names.entry(module)
            cls = type(module)
            if entry is None or f"{cls.__module__}:{cls.__qualname__}.forward" not in targets:
                continue
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
        self.slots: dict[str, int] = {}
        self.order: list[str] = []
        self._handles: list[Any] = []
        self._names = names
        self._taken: dict[int, Any] = {}

    def attach(self) -> CompiledTap:
        options = self.recorder.options
        for module, entry in self.modules:
            _, name_in, name_out, _, is_layer = entry
            if options.inputs == "all" or is_layer:
                self._handles.append(module.register_forward_pre_hook(
                    self._pre_hook(name_in), with_kwargs=True))
            if options.depth != "layers" or is_layer:
                self._handles.append(module.register_forward_hook(self._hook(entry[0])))
            key = id(module)
            self._taken[key] = self._names._names.pop(key, None)
        self.recorder.compiled = self
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for key, entry in self._taken.items():
            if entry is not None:
                self._names._names[key] = entry
        self._taken.clear()
        if self.recorder.compiled is self:
            self.recorder.compiled = None

    def _slot(self, name: str) -> int:
        slot = self.slots.get(name)
        if slot is None:
            slot = self.slots[name] = len(self.order)
            self.order.append(name)
            if slot >= self.buffer.shape[0]:
                logger.warning("tap: %s not placed under torch.compile (more checkpoints "
                               "than the buffer's %d slots)", name, self.buffer.shape[0])
        return slot

    def _pre_hook(self, name: str) -> Any:
        def tap_input(module: Any, args: tuple, kwargs: dict) -> None:
            hidden = _hidden(args, kwargs)
            if isinstance(hidden, torch.Tensor):
                torch.ops.enginetap.tap_hash_rows(self.buffer, hidden, self.index,
                                                  self._slot(name))
        return tap_input

    def _hook(self, base: str) -> Any:
        def tap_output(module: Any, args: tuple, out: Any) -> None:
            for suffix, tensor in outputs_of(out):
                if isinstance(tensor, torch.Tensor):
                    torch.ops.enginetap.tap_hash_rows(self.buffer, tensor, self.index,
                                                      self._slot(f"{base}.{suffix}"))
        return tap_output

    # -- per step (the recorder calls these) -----------------------------------------

    def begin(self, padded: int, index: torch.Tensor) -> None:
        """Before the forward: the step's tapped rows, and every slot unwritten. The
        index tensor is refilled in place where its size allows (the compiled graph
        reads it as an input)."""
        values = torch.cat([torch.tensor([padded], dtype=torch.int64),
                            index.to("cpu", torch.int64)])
        if self.index.numel() == values.numel():
            self.index.copy_(values)
        else:
            self.index = values.to(self.buffer.device)
        self.buffer[:, -1] = 0

    def collect(self, k: int) -> tuple[list[str], torch.Tensor]:
        """After the forward: the names written this step in execution order, and their
        ``[names, k]`` hashes on the host."""
        host = self.buffer[:len(self.order)].cpu()
        written = [i for i in range(min(len(self.order), host.shape[0])) if host[i, -1]]
        return [self.order[i] for i in written], host[written, :k].contiguous()
