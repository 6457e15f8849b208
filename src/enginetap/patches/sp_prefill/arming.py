"""The ``sp_prefill`` capability: install sequence-parallel prefill in a vLLM worker.

A refusal (a drifted vLLM, TP 1, a failed precondition) is logged with every reason,
written to ``<out_dir>/sp_prefill-refused-rank<r>.json`` and leaves nothing installed:
the stock engine serves, and the other armed capabilities stay armed.
"""

from __future__ import annotations

import json
import logging

from enginetap.core.capability import ArmContext, InstallResult
from enginetap.errors import ProblemsError
from enginetap.patches.sp_prefill.options import SpPrefillOptions

logger = logging.getLogger("enginetap.sp_prefill")

__all__ = ["install"]


def install(context: ArmContext) -> InstallResult:
    options = context.options_of("sp_prefill")
    assert isinstance(options, SpPrefillOptions)
    if options.mode == "off":
        return None, "sp_prefill (mode off: nothing installed)"
    from enginetap.patches.sp_prefill.patch import SpPrefill

    patch = SpPrefill(options, context.out_dir if context.config.enabled else None,
                      context.rank, context.world_size)
    try:
        patch.install()
    except ProblemsError as exc:  # DriftError, RequirementError: refuse, serve stock
        _refused(context, exc)
        return None, f"sp_prefill (refused: {exc.what}; vLLM serves its stock path)"
    # Forwards may now be split across ranks: whoever joins their rows (the tap) must do
    # it at the same calls on every rank (a collective), never decide it per rank later.
    context.notes["rows_split"] = True
    return patch, (f"sp_prefill (mode {options.mode}, min_rows {options.min_rows}, "
                   f"TP {context.world_size})")


def _refused(context: ArmContext, exc: ProblemsError) -> None:
    logger.error("enginetap sp_prefill refused: %s", exc)
    path = context.out_dir / f"sp_prefill-refused-rank{context.rank}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"what": exc.what, "problems": list(exc.problems)}, indent=2))
    except OSError as err:
        logger.error("enginetap sp_prefill: cannot write %s: %s", path, err)
