"""Install sequence-parallel prefill in a vLLM worker: lock, routes, proofs, records.

Three kinds of wrappers, all through :mod:`enginetap.core.patching`:

- on each supported model's ``forward`` (the layer loop), a guard
  :class:`~enginetap.guard.ExactPatch` whose patched implementation is the same stock
  ``forward`` run under a :class:`~.plan.Plan`. Its ``applies`` predicate is the route:
  a chunk runs the stock path unless a step is current and not a decode step, it has at
  least ``min_rows`` rows, divisible by the TP size, and the model's layers are ones this
  patch shards. Eligible chunks go through the proof: the first chunk of each shape runs
  both paths on the same inputs (sharded first, stock last, so the KV cache ends as stock
  wrote it), compares the final hidden states, agrees over the TP group (MIN) and serves
  stock; later chunks of that shape run the path the proof chose;
- on the supported decoder layers' ``forward`` (:mod:`.dense`, :mod:`.deepseek`), and
  DeepSeek's MoE forward and loop gather (:mod:`.deepseek`);
- on the module-level ``tensor_model_parallel_all_reduce`` that vLLM's
  ``RowParallelLinear.forward`` and MoE runner call: inside a plan it reduces as the mode
  says, otherwise it counts the stock all-reduce's bytes and calls it.

Every route decision reads only the step's mode, the chunk's shape and static config,
so every rank takes the same one at the same call.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any, get_args

from enginetap.core import context
from enginetap.core.jsonl import RankJsonl
from enginetap.core.patching import PatchSet, resolve
from enginetap.core.tensors import capturing
from enginetap.guard.exact import ExactPatch
from enginetap.guard.keys import shape_key
from enginetap.guard.lock import check_lock
from enginetap.guard.require import engine_version, holds, require
from enginetap.patches.sp_prefill import LOCK
from enginetap.patches.sp_prefill import deepseek, dense
from enginetap.errors import ConfigError
from enginetap.patches.sp_prefill.options import Mode, SpPrefillOptions
from enginetap.patches.sp_prefill.plan import ChunkRecord, Plan, active, current_plan

logger = logging.getLogger("enginetap.sp_prefill")

MODEL_TARGETS: dict[str, tuple[str, Callable[[Any], str] | None]] = {
    "vllm.model_executor.models.llama:LlamaModel.forward": ("LlamaDecoderLayer", None),
    "vllm.model_executor.models.qwen2:Qwen2Model.forward": ("Qwen3DecoderLayer", None),
    "vllm.model_executor.models.deepseek_v2:DeepseekV2Model.forward":
        ("DeepseekV2DecoderLayer", deepseek.refusal),
}
"""Layer loops the patch runs under a plan: the decoder layer class every layer must be,
and the model's own further refusal ('' when covered)."""
_MOE_RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
ALL_REDUCES = (
    "vllm.model_executor.layers.linear:tensor_model_parallel_all_reduce",
    f"{_MOE_RUNNER}:tensor_model_parallel_all_reduce",
)
"""The all-reduce of ``RowParallelLinear.forward`` and the MoE runner's reductions."""
WRAPPERS: list[tuple[str, Any]] = [
    *((target, dense.layer_wrapper) for target in dense.LAYER_TARGETS),
    (deepseek.LAYER_TARGET, deepseek.layer_wrapper),
    (deepseek.MOE_TARGET, deepseek.moe_wrapper),
    (deepseek.LOOP_GATHER, deepseek.loop_gather),
]
PINNED = sorted([
    *MODEL_TARGETS, *dense.LAYER_TARGETS, deepseek.LAYER_TARGET, deepseek.MOE_TARGET,
    "vllm.model_executor.layers.linear:RowParallelLinear.forward",
    "vllm.model_executor.models.llama:LlamaAttention.forward",
    "vllm.model_executor.models.llama:LlamaMLP.forward",
    "vllm.model_executor.models.qwen3:Qwen3Attention.forward",
    "vllm.model_executor.models.qwen2:Qwen2MLP.forward",
    "vllm.model_executor.models.deepseek_v2:DeepseekV2MLAAttention.forward",
    "vllm.model_executor.models.deepseek_v2:DeepseekV2MLP.forward",
    f"{_MOE_RUNNER}:MoERunner._maybe_reduce_final_output",
    f"{_MOE_RUNNER}:MoERunner._maybe_reduce_shared_expert_output",
    "vllm.model_executor.layers.layernorm:RMSNorm.forward_native",
    "vllm.model_executor.layers.layernorm:RMSNorm.forward_cpu",
    "vllm.distributed.parallel_state:GroupCoordinator.all_gather",
    "vllm.distributed.parallel_state:GroupCoordinator.reduce_scatter",
    "vllm.distributed.parallel_state:GroupCoordinator.all_reduce",
    "vllm.distributed.device_communicators.cpu_communicator:CpuCommunicator.all_gather",
])
"""What the patch replaces or relies on, pinned in ``sp_prefill.lock``: the layer loops and
layers it mirrors, the projection and MoE reductions it reroutes, the attention, MLP and
MoE forwards it calls on gathered rows, the norms it runs on shards (row-local), the
collectives."""

__all__ = ["ALL_REDUCES", "MODEL_TARGETS", "PINNED", "WRAPPERS", "SpPrefill", "installed",
           "set_worker_mode"]


class SpPrefill:
    """Sequence-parallel prefill installed in one vLLM worker (one TP rank).

    Raises (from :meth:`install`):
        RequirementError: not vLLM 0.32, TP size 1, or pipeline parallelism.
        DriftError: a pinned vLLM source differs from ``sp_prefill.lock``.
    """

    def __init__(self, options: SpPrefillOptions, out_dir: Path | None, rank: int,
                 world: int) -> None:
        self.options = options
        self.out_dir = out_dir
        self.rank, self.world = rank, world
        self.mode: Mode = options.mode
        self.proofs: dict[str, ExactPatch] = {}
        self._patches = PatchSet("sp_prefill")
        self._records = (RankJsonl(out_dir / "sp_prefill.jsonl", rank)
                         if out_dir is not None and options.record else None)
        self._pending: list[ChunkRecord] = []

    # ------------------------------------------------------------------ lifecycle
    def install(self) -> SpPrefill:
        from vllm.distributed.parallel_state import get_pp_group

        require(engine_version("vllm", ">=0.32,<0.33"),
                holds(self.world >= 2, f"tensor parallelism of 2 or more (this worker: "
                                       f"{self.world}): at TP 1 there is nothing to shard"),
                holds(get_pp_group().world_size == 1, "no pipeline parallelism"),
                what="sp_prefill")
        check_lock(LOCK)
        for target in ALL_REDUCES:
            self._patches.add(target, self._all_reduce)
        for target, wrapper in WRAPPERS:
            self._patches.add(target, wrapper)
        self._patches.install()
        try:
            for target in MODEL_TARGETS:
                self.proofs[target] = self._proof(target).install()
        except BaseException:
            self.uninstall()
            raise
        context.subscribe(on_end=self._flush)
        global _INSTALLED
        _INSTALLED = self
        return self

    def set_mode(self, mode: Mode) -> None:
        """Switch the mode of this rank from now on (every rank must switch between the
        same two forwards). Proofs are kept per mode, so a shape proven in a mode stays
        proven when the mode comes back.

        Raises:
            ConfigError: an unknown mode.
        """
        if mode not in get_args(Mode):
            raise ConfigError(f"unknown sp_prefill mode {mode!r}",
                              f"modes are {', '.join(get_args(Mode))}", "pick one of them")
        self.mode = mode
        for proof in self.proofs.values():
            proof.tolerance = self._tolerance()

    def _tolerance(self) -> float:
        return 0.0 if self.mode == "exact" else self.options.tolerance

    def _key(self, args: tuple, kwargs: dict) -> Any:
        return self.mode, shape_key(args, kwargs)

    def uninstall(self) -> None:
        global _INSTALLED
        if _INSTALLED is self:
            _INSTALLED = None
        context.unsubscribe(self._flush)
        for proof in self.proofs.values():
            proof.uninstall()
        self.proofs.clear()
        self._patches.uninstall()

    def _proof(self, target: str) -> ExactPatch:
        original = resolve(target, raw=True)
        name = f"sp_prefill.{target.rpartition(':')[2].partition('.')[0]}"
        proof = ExactPatch(target, self._sharded(original), name=name, key=self._key,
                           mutates=(), tolerance=self._tolerance(), dump_dir=self._dump_dir())
        proof.applies = self._route(proof, *MODEL_TARGETS[target])
        return proof

    # ------------------------------------------------------------------ routing
    def _route(self, proof: ExactPatch, layer_class: str,
               refusal: Callable[[Any], str] | None):
        def applies(model: Any, args: tuple, kwargs: dict) -> bool:
            step = context.current_step()
            positions = _positions(args, kwargs)
            if step is None or positions is None:
                return False  # dummy, profile and warm-up runs: never ours, never recorded
            record = ChunkRecord(step.step, step.mode, int(positions.shape[0]), self.mode)
            record.row_local_rows = record.rows
            self._pending.append(record)
            reason = self._refusal(model, step.mode, record.rows, layer_class, kwargs)
            if not reason and refusal is not None:
                reason = refusal(model)
            if reason:
                record.reason = reason
                return False
            record.path = _path(proof, self._key(args, kwargs))
            return True
        return applies

    def _refusal(self, model: Any, step_mode: str, rows: int, layer_class: str,
                 kwargs: dict) -> str:
        """Why this forward runs stock ('' when it is eligible)."""
        if self.mode == "off":
            return "off"
        if step_mode == "decode":
            return "decode"
        if rows < self.options.min_rows:
            return "below_min_rows"
        if rows % self.world:
            return "not_divisible"
        if capturing():
            return "capturing"
        layers = model.layers[model.start_layer:model.end_layer]
        if any(type(layer).__name__ != layer_class for layer in layers):
            return "unsupported_layers"
        if getattr(model, "aux_hidden_state_layers", ()) or set(kwargs) - _MODEL_ARGUMENTS:
            return "unsupported_arguments"
        return ""

    def _sharded(self, original: Any):
        def forward(model: Any, *args: Any, **kwargs: Any) -> Any:
            from vllm.distributed.parallel_state import get_tp_group

            # The record the route opened for this forward (a proof counts both paths).
            record = self._pending[-1] if self._pending else None
            rows = int(_positions(args, kwargs).shape[0])
            plan = Plan(self.mode, rows, self.rank, self.world,
                        model.end_layer - model.start_layer, get_tp_group(), record,
                        self.options.compare, self._dump_dir())
            if record is not None and record.path == "sp" and plan.sharded:
                record.row_local_rows = plan.shard
            with active(plan):
                return original(model, *args, **kwargs)
        return forward

    def _dump_dir(self) -> Path | None:
        return self.out_dir / "sp_prefill-dumps" if self.out_dir is not None else None

    # ------------------------------------------------------------------ the all-reduce
    def _all_reduce(self, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        plan = current_plan()
        if plan is not None:
            return plan.reduce(args[0] if args else kwargs["input_"])
        record = self._pending[-1] if self._pending else None
        if record is None or context.current_step() is None:
            return wrapped(*args, **kwargs)
        start = time.perf_counter()
        out = wrapped(*args, **kwargs)
        record.count("all_reduce", out.numel() * out.element_size(), time.perf_counter() - start)
        return out

    # ------------------------------------------------------------------ records
    def _flush(self, step: Any) -> None:
        pending, self._pending = self._pending, []
        if self._records is None:
            return
        for record in pending:
            try:
                self._records.write(dataclasses.asdict(record), step=record.step)
            except OSError as exc:
                logger.error("enginetap sp_prefill: cannot write its record: %s", exc)
                self._records = None
                return


_INSTALLED: SpPrefill | None = None


def installed() -> SpPrefill | None:
    """This process's installed sp_prefill (one per vLLM worker), else None."""
    return _INSTALLED


def set_worker_mode(worker: Any, mode: str) -> str:
    """For ``LLM.collective_rpc(set_worker_mode, args=(mode,))``: switch every worker's
    mode between two requests (benchmarks interleave modes in one engine this way).

    Raises:
        ConfigError: sp_prefill is not installed in this worker, or an unknown mode.
    """
    patch = installed()
    if patch is None:
        raise ConfigError("sp_prefill is not installed in this vLLM worker",
                          "it was not armed, or it was refused (see the log)",
                          "arm it with ENGINETAP_CAPABILITIES=sp_prefill")
    patch.set_mode(mode)  # type: ignore[arg-type]
    return mode


_MODEL_ARGUMENTS = {"input_ids", "positions", "intermediate_tensors", "inputs_embeds"}


def _positions(args: tuple, kwargs: dict) -> Any:
    if "positions" in kwargs:
        return kwargs["positions"]
    return args[1] if len(args) > 1 else None


def _path(proof: ExactPatch, key: Any) -> str:
    if proof.mode == "compare":
        return "compare"
    decision = proof.decisions.get(key)
    if decision is None:
        return "proof"
    return "sp" if decision.patched else "fallback"
