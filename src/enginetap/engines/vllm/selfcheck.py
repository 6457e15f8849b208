"""Tensor-parallel self-check: rebuild sharded weights with :func:`gather_shards`.

Armed with ``options.step.selfcheck_gather: true``, every worker, once vLLM loaded the
checkpoint's shards into the model and before it post-processes them (vLLM CPU repacks
linear weights for its GEMM kernels and leaves empty parameters behind), gathers the
weights of its plainly sharded layers (row-parallel and single-matrix column-parallel
linears, vocab-parallel embeddings and heads) over the tensor-parallel group, and rank 0
writes them under vLLM's parameter names to ``<out_dir>/selfcheck-gather.safetensors``.
Compared with the checkpoint, the file shows that rank discovery, the group and the
gather agree with how vLLM sharded the model.

Merged layers (QKV, gate-up) interleave several matrices per shard and are skipped: their
gathered shards are not a checkpoint tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from enginetap.core.patching import PatchSet, bind_arguments
from enginetap.core.ranks import agree, gather_shards, rank_world

logger = logging.getLogger("enginetap.vllm")

SELFCHECK_FILE = "selfcheck-gather.safetensors"
# base_loader calls it by the name it imported, so that name is the one to patch.
AFTER_LOADING = "vllm.model_executor.model_loader.base_loader:process_weights_after_loading"

__all__ = ["AFTER_LOADING", "SELFCHECK_FILE", "GatherSelfCheck", "sharded_weights",
           "weights_loaded_patch"]


def weights_loaded_patch(name: str, callback: Callable[[Any], None], *,
                         before_processing: bool) -> PatchSet:
    """A patch (not installed) calling ``callback(model)`` once vLLM loaded a model's
    weights: before it processes them (repacking for its kernels) or after."""

    def on_loaded(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        model = bind_arguments(wrapped, args, kwargs)["model"]
        if before_processing:
            callback(model)
        result = wrapped(*args, **kwargs)
        if not before_processing:
            callback(model)
        return result

    patches = PatchSet(name)
    patches.add(AFTER_LOADING, on_loaded)
    return patches


class GatherSelfCheck:
    """Runs the gather self-check in each worker between weight loading and processing."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / SELFCHECK_FILE
        self.patches = weights_loaded_patch("selfcheck-gather", self.run, before_processing=True)

    def install(self) -> GatherSelfCheck:
        self.patches.install()
        return self

    def uninstall(self) -> None:
        self.patches.uninstall()

    def run(self, model: Any) -> None:
        """Gather every plainly sharded weight of ``model``; rank 0 writes the file."""
        from safetensors.torch import save_file

        rank, world = rank_world()
        gathered = {name: gather_shards(shard, dim) for name, shard, dim in sharded_weights(model)}
        agreed = agree(bool(gathered))
        if rank != 0:
            return
        tensors = {name: t.contiguous() for name, t in gathered.items()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(self.path),
                  metadata={"world_size": str(world), "agreed": str(agreed).lower()})
        logger.info("enginetap: gathered %d sharded weights into %s", len(tensors), self.path)


def sharded_weights(model: Any) -> Iterator[tuple[str, Any, int]]:
    """``(parameter name, this rank's real shard, sharded dim)`` in a rank-independent order."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for prefix, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or weight.dim() != 2:
            continue
        name = f"{prefix}.weight" if prefix else "weight"
        if isinstance(module, VocabParallelEmbedding):
            # Rows past the shard's real vocabulary are padding; only the real ones gather.
            yield name, weight[: module.shard_indices.num_org_elements], 0
        elif isinstance(module, RowParallelLinear):
            yield name, weight, weight.input_dim
        elif isinstance(module, ColumnParallelLinear) and not isinstance(
                module, (MergedColumnParallelLinear, QKVParallelLinear)):
            yield name, weight, weight.output_dim
