"""Built-in candidate solutions: the kernel libraries people ship, adapted to definitions.

Each :class:`BuiltinSolution` is data: a name (``fla:gdn``), the library and modules it
needs, the devices it runs on, and per family the ``module:function`` of an adapter factory.
A factory takes the :class:`Definition` and returns a function with the definition's
signature (inputs positionally, outputs returned) that converts the canonical layout to the
library's call and back. ``enginetap replay --solution NAME`` takes these names as well as a
user's ``module:function``; a name here wins.

:meth:`BuiltinSolution.skip_reason` says, in the parent process and before anything runs,
why a solution cannot be checked on a definition (family not covered, library not
installed, device it does not run on): replay reports those as SKIPPED, never as PASS.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from enginetap.core.patching import resolve
from enginetap.definitions.base import family_of

if TYPE_CHECKING:
    from enginetap.dataset.schema import Definition

__all__ = ["BUILTINS", "UNCOVERED", "BuiltinSolution", "builtin_named"]

_HERE = "enginetap.replay.builtin"
UNCOVERED = "no adapter for "
"""How a skip reason starts when the solution does not cover the family at all."""


@dataclass(frozen=True)
class BuiltinSolution:
    """One library's kernels as candidates for the families it covers."""

    name: str
    library: str
    """What to install (pip names), for the SKIPPED reason."""
    modules: tuple[str, ...]
    """Import names that must be present."""
    devices: tuple[str, ...]
    """``cpu`` and/or ``cuda``."""
    adapters: Mapping[str, str]
    """Family -> ``module:factory``."""
    summary: str
    _made: dict[str, Callable[..., Any]] = field(default_factory=dict, compare=False, repr=False)

    def skip_reason(self, definition: Definition, device: str) -> str | None:
        """Why this solution cannot run ``definition`` on ``device`` (None: it can)."""
        family = family_of(definition)
        if family not in self.adapters:
            return (f"{UNCOVERED}{family or 'a definition without a family tag'} "
                    "(--list-solutions shows what each covers)")
        kind = "cuda" if device.startswith("cuda") else device
        if kind not in self.devices:
            return f"{self.name} runs on {'/'.join(self.devices)} only; this replay runs on {device}"
        missing = [m for m in self.modules if importlib.util.find_spec(m) is None]
        if missing:
            return f"{', '.join(missing)} not installed (pip install {self.library})"
        return None

    def adapter(self, definition: Definition) -> Callable[..., Any]:
        """The function for ``definition`` (made once per definition name).

        Raises:
            KeyError: the family is not covered. ResolveError: the adapter cannot be imported.
        """
        made = self._made.get(definition.name)
        if made is None:
            factory = resolve(self.adapters[family_of(definition) or ""])
            made = self._made[definition.name] = factory(definition)
        return made


def _adapters(module: str, *families: str) -> dict[str, str]:
    """Each family's adapter factory: the function of that name in ``module`` here."""
    return {family: f"{_HERE}.{module}:{family}" for family in families}


BUILTINS: tuple[BuiltinSolution, ...] = (
    BuiltinSolution(
        name="fla:gdn", library="fla-core flash-linear-attention",
        modules=("fla", "triton"), devices=("cuda",),
        adapters=_adapters("fla", "gdn_prefill", "gdn_decode"),
        summary="flash-linear-attention: chunk_gated_delta_rule (prefill, varlen, states), "
                "fused_recurrent_gated_delta_rule (decode)"),
    BuiltinSolution(
        name="liger:rmsnorm", library="liger-kernel", modules=("liger_kernel", "triton"),
        devices=("cuda",),
        adapters=_adapters("liger", "rmsnorm", "rmsnorm_offset", "fused_add_rmsnorm"),
        summary="Liger Triton kernels: rms_norm_forward, fused_add_rms_norm_forward "
                "(casting mode from the definition's rounding)"),
    BuiltinSolution(
        name="torch:sdpa", library="torch", modules=("torch",), devices=("cpu", "cuda"),
        adapters=_adapters("sdpa", "gqa_ragged_prefill", "gqa_paged_decode", "mla_paged_decode"),
        summary="torch.nn.functional.scaled_dot_product_attention per request (pages "
                "gathered; lse beside it by logsumexp)"),
    BuiltinSolution(
        name="torch:flex", library="torch", modules=("torch",), devices=("cpu", "cuda"),
        adapters=_adapters("flex", "gqa_ragged_prefill", "gqa_paged_decode", "mla_paged_decode",
                           "dsa_sparse_mla", "sparse_mla_prefill_sink",
                           "sparse_gqa_paged_decode", "mla_paged_prefill",
                           "mla_decode_fp8_fp4_sink"),
        summary="torch flex_attention with a block mask (document, page and sparse-index "
                "masks), one call per workload; its lse natively (compiled on cuda)"),
)
"""Every built-in solution, in the order ``--list-solutions`` shows them."""


def builtin_named(name: str) -> BuiltinSolution | None:
    """The built-in solution called ``name``, if any."""
    return next((b for b in BUILTINS if b.name == name), None)
