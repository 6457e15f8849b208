"""What an armed compiled model needs from inductor so that the tap's ops observe the graph
without changing what it computes.

Two things changed a compiled vLLM model's tokens once the tap's op was in its graph
(tiny qwen3_next on vLLM CPU, torch 2.13; docs/tap.md, vLLM compiled mode):

- **Rounding.** Inductor fuses pointwise ops and keeps their intermediates in fp32 (it
  drops the downcast to bf16 between two fused ops). A tapped value the graph never
  stores (a MoE block's output, fused into the next layer's residual add and norm) had to
  be stored, in bf16, for the op to read, and the consumers then read that rounded copy.
  :class:`TapCopies` (a post-grad pass) gives each tap op its own copy of the pointwise
  chain that computes its value, so the engine's nodes keep their users, their fusion and
  their precision; the copy is stored (rounded to the value's dtype) for the op alone.
- **A lost dependency.** The CPU backend recomputes a node's loop body when it fuses
  nodes of different shapes (``SchedulerNode.recompute_size_and_body``), and in doing so
  forgets the node's mutation renames unless it had fake dependencies: a node reading a
  buffer that an out-variant op wrote (vLLM's ``_C.cpu_fused_moe`` into its ``output``)
  then reads it as if unwritten, and may be fused into a kernel that runs before that op.
  The tap made the shared expert's gated output a stored buffer ahead of the routed
  experts; the kernel computing it took in the block's sum and the next norm, and read the
  routed experts' output before they wrote it. :data:`KEEP_RENAMES` re-applies the renames.

:func:`observe_without_changing` installs both (once, for the process): the pass only
rewrites inputs of ``enginetap::tap_hash_rows*`` ops, the patch only restores
dependencies that the graph's own data flow has.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["KEEP_RENAMES", "TapCopies", "copy_tapped_values", "observe_without_changing",
           "stop_observing"]

logger = logging.getLogger("enginetap.tap")

KEEP_RENAMES = "torch._inductor.scheduler:SchedulerNode.recompute_size_and_body"
_installed: list[Any] = []


def _tap_ops() -> set[Any]:
    ops = torch.ops.enginetap
    return {ops.tap_hash_rows.default, ops.tap_hash_rows_fixed.default}


def _tapped(node: torch.fx.Node, taps: set[Any]) -> tuple[str | int, Any] | None:
    """Where ``node``, if a tap op (plain or auto-functionalized), has its tapped value:
    ``(kwarg name or arg position, value)``."""
    if node.op != "call_function":
        return None
    functionalized = (torch.ops.higher_order.auto_functionalized,
                      torch.ops.higher_order.auto_functionalized_v2)
    if node.target in functionalized and node.args and node.args[0] in taps:
        return "tensor", node.kwargs["tensor"]
    if node.target not in taps:
        return None
    return ("tensor", node.kwargs["tensor"]) if "tensor" in node.kwargs else (1, node.args[1])


def _copyable(node: torch.fx.Node) -> bool:
    """A functional aten/prims op that inductor computes inside a fused kernel."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace not in ("aten", "prims") or target._schema.is_mutable:
        return False
    return (torch.Tag.pointwise in target.tags or target.is_view
            or target is torch.ops.prims.convert_element_type.default)


def _users(node: torch.fx.Node, taps: set[Any]) -> int:
    return sum(1 for user in node.users if _tapped(user, taps) is None)


def copy_tapped_values(graph: torch.fx.Graph) -> int:
    """Point every tap op of ``graph`` at its own copy of the pointwise chain computing its
    value: the tapped node, and each node of its chain used by nothing else (a node with
    other users, or not pointwise, is read as it is: one more reader changes neither its
    fusion nor its precision). Returns how many tap ops now read a copy."""
    taps, copied = _tap_ops(), 0
    for node in list(graph.nodes):
        found = _tapped(node, taps)
        if found is None or not isinstance(found[1], torch.fx.Node) \
                or not _copyable(found[1]):
            continue
        key, value = found
        with graph.inserting_before(node):
            fresh = _copy(graph, value, taps, top=True)
        if isinstance(key, int):
            node.args = (*node.args[:key], fresh, *node.args[key + 1:])
        else:
            node.kwargs = {**node.kwargs, key: fresh}
        copied += 1
    return copied


def _copy(graph: torch.fx.Graph, node: Any, taps: set[Any], top: bool = False) -> Any:
    if not isinstance(node, torch.fx.Node) or not _copyable(node) or (
            not top and _users(node, taps) != 1):
        return node
    args = torch.fx.map_arg(node.args, lambda a: _copy(graph, a, taps))
    kwargs = torch.fx.map_arg(node.kwargs, lambda a: _copy(graph, a, taps))
    fresh = graph.call_function(node.target, args, kwargs)
    fresh.meta = dict(node.meta)
    return fresh


class TapCopies(CustomGraphPass):
    """Inductor's post-grad pre-pass running :func:`copy_tapped_values` (and the pass that
    was configured before it, if any)."""

    def __init__(self, before: Any = None) -> None:
        self.before = before

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.before is not None:
            self.before(graph)
        copied = copy_tapped_values(graph)
        if copied:
            logger.debug("tap: %d tap ops read their own copy of the tapped value", copied)

    def uuid(self) -> Any:
        own = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
        before = getattr(self.before, "uuid", lambda: None)() if self.before else None
        return (own, before)


def _keep_renames(wrapped: Any, node: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    renames = getattr(node, "mutation_renames", None)
    if renames:
        node.set_read_writes(node.read_writes.rename(renames))
    return result


def observe_without_changing() -> None:
    """Install :class:`TapCopies` and the scheduler fix (see the module docstring) for
    this process, once; later compiles of a tapped graph use them."""
    if _installed:
        return
    from torch._inductor import config

    from enginetap.core.patching import PatchSet
    from enginetap.errors import PatchError

    before = config.post_grad_custom_pre_pass
    if not isinstance(before, TapCopies):
        config.post_grad_custom_pre_pass = TapCopies(before)
    patches = PatchSet("tap-inductor")
    patches.add(KEEP_RENAMES, _keep_renames)
    try:
        _installed.append(patches.install())
    except PatchError as exc:  # another torch: the copies still apply
        _installed.append(PatchSet("tap-inductor"))
        logger.warning("tap: inductor's scheduler not patched (%s): a compiled graph's "
                       "node may read an out-variant op's output before it is written", exc)


def stop_observing() -> None:
    """Undo :func:`observe_without_changing` (tests: graphs compiled later are untapped)."""
    from torch._inductor import config

    if not _installed:
        return
    _installed.pop().uninstall()
    if isinstance(config.post_grad_custom_pre_pass, TapCopies):
        config.post_grad_custom_pre_pass = config.post_grad_custom_pre_pass.before
