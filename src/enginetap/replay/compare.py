"""Comparing one output tensor with its expected value, following a :class:`CompareRule`.

Every comparison first checks structure: the actual tensor must have the expected shape and
dtype (a definition fixes both), otherwise it fails with that reason and no numbers.

``float``: an element matches when ``|actual - expected| <= atol + rtol * |expected|``,
computed in float64. A NaN matches only a NaN at the same place, an infinity only the same
infinity, so a NaN the expected tensor does not have always fails (counted as
``unexpected_nan``). When the rule leaves ``atol``/``rtol`` unset, the expected dtype
decides (about two units in the last place of that format, so rounding a float32
computation to it passes while a real difference does not):

==================  ========  ========
dtype               atol      rtol
==================  ========  ========
float32 / float64   1e-5      1e-5
float16             1e-3      1e-3
bfloat16            1e-2      1e-2
float8_e4m3fn       1.25e-1   1.25e-1
float8_e5m2         2.5e-1    2.5e-1
==================  ========  ========

``max_abs_error`` is the largest ``|actual - expected|`` over elements finite in both;
``max_rel_error`` the largest ``|actual - expected| / |expected|`` over those with a
non-zero expected value; ``matched_ratio`` the fraction of elements that match. The output
passes only when every element matches. Mismatches where either side is NaN or infinite
are not in those maxima: they are counted (``nonfinite``, ``unexpected_nan``,
``missing_nan``), and ``first_mismatch`` names the first element that differs with both
values, so that a failure never reads as an error of 0.

``exact``: every element equal (NaN equals NaN at the same place); the numbers are reported
as for ``float``. Packed fp4 (``float4_e2m1fn_x2``), which torch cannot convert, is always
compared bit for bit, as ``exact`` over its bytes.

``selection``: the last dimension holds an unordered set of indices (top-k ids), ``-1``
marks padding. Each row (all leading dimensions flattened) matches when its indices, as a
set, equal the expected row's; a row with a repeated index never matches. When the rule
names ``scores`` (an input, or else an output, whose reference value is used), its leading
dimensions equal the rows' and the rest, flattened row-major, is indexed by the selected
ids. A row whose set differs is then still accepted if the indices it has instead can be
paired one to one with the indices it lacks so that the scores of each pair differ by at
most ``atol`` (default: the float ``atol`` of the scores' dtype); an id outside the scores,
or a non-finite score, never ties. Both lists are sorted by score and paired in order:
that pairing minimises the largest difference, so the row is accepted exactly when such a
pairing exists. ``matched`` counts rows, ``ties`` the rows accepted by a tie.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from enginetap.definitions.base import CompareRule

if TYPE_CHECKING:
    import torch

__all__ = ["Comparison", "compare_outputs", "default_tolerance", "fallback_rule"]

_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-5, 1e-5),
    "float32": (1e-5, 1e-5),
    "float16": (1e-3, 1e-3),
    "bfloat16": (1e-2, 1e-2),
    "float8_e4m3fn": (1.25e-1, 1.25e-1),
    "float8_e5m2": (2.5e-1, 2.5e-1),
}

_PACKED = {"float4_e2m1fn_x2"}


class Comparison(BaseModel):
    """The outcome of comparing one output with its expected value."""

    kind: Literal["float", "exact", "selection"]
    passed: bool
    reason: str | None = None
    """Why it failed, in one line (``None`` when it passed)."""
    shape: list[int]
    """Shape of the expected tensor."""
    dtype: str
    """Dtype of the expected tensor."""
    atol: float | None = None
    rtol: float | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    matched: int = 0
    """Matching elements (rows, for ``selection``)."""
    total: int = 0
    matched_ratio: float = 1.0
    unexpected_nan: int = 0
    """NaNs in the actual tensor where the expected one has none."""
    missing_nan: int = 0
    """Numbers in the actual tensor where the expected one has NaN."""
    nonfinite: int = 0
    """Differing elements where either side is NaN or infinite (outside the error maxima)."""
    first_mismatch: str | None = None
    """The first differing element: ``[i, j]: expected x, got y``."""
    ties: int = 0
    """``selection`` rows accepted because the differing indices' scores tie."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` used for ``dtype`` when a rule leaves them unset (see module doc)."""
    return _TOLERANCES.get(_dtype_name(dtype), _TOLERANCES["float32"])


def fallback_rule(dtype: torch.dtype) -> CompareRule:
    """The rule for an output no template describes: floats by tolerance, the rest exact."""
    return CompareRule(kind="float" if dtype.is_floating_point else "exact")


def compare_outputs(rule: CompareRule, expected: torch.Tensor, actual: torch.Tensor, *,
                    scores: torch.Tensor | None = None,
                    pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> Comparison:
    """Compare ``actual`` with ``expected`` as ``rule`` says (see the module docstring).

    ``scores`` is the tensor ``rule.scores`` names (``selection`` only). ``pairs`` holds the
    expected and actual values of the selection output ``rule.paired_with`` names: each
    side's rows are then put in the order of its own ids before comparing, since engines
    list a row's selected ids in any order.
    Never raises on mismatching tensors: a structural mismatch is a failed comparison.
    """
    import torch

    actual = actual.to(expected.device)
    if pairs is not None and _pairable(expected, actual, *pairs):
        expected = _by_ids(expected, pairs[0])
        actual = _by_ids(actual, pairs[1].to(expected.device))
    base = {"kind": rule.kind, "shape": list(expected.shape), "dtype": _dtype_name(expected.dtype)}
    problem = _structure_problem(expected, actual)
    if problem is not None:
        return Comparison(passed=False, reason=problem, total=expected.numel(),
                          matched_ratio=0.0, **base)
    if _dtype_name(expected.dtype) in _PACKED:
        rule, base["kind"] = CompareRule(kind="exact"), "exact"
        expected, actual = expected.view(torch.uint8), actual.view(torch.uint8)
    if rule.kind == "selection":
        return _compare_selection(rule, expected, actual, scores, base)
    return _compare_elements(rule, expected, actual, base)


def _pairable(expected: torch.Tensor, actual: torch.Tensor, expected_ids: torch.Tensor,
              actual_ids: torch.Tensor) -> bool:
    # Rows can only be re-ordered by ids of the same shape; otherwise compare as they are
    # and let the structural check report the mismatch.
    return expected.shape == expected_ids.shape and actual.shape == actual_ids.shape


def _by_ids(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    order = ids.to(values.device).long().argsort(dim=-1, stable=True)
    return values.gather(-1, order)


def _structure_problem(expected: torch.Tensor, actual: torch.Tensor) -> str | None:
    if actual.shape != expected.shape:
        return f"shape {list(actual.shape)}, expected {list(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"dtype {_dtype_name(actual.dtype)}, expected {_dtype_name(expected.dtype)}"
    return None


def _compare_elements(rule: CompareRule, expected: torch.Tensor, actual: torch.Tensor,
                      base: dict[str, Any]) -> Comparison:
    import torch

    e, a = expected.to(torch.float64), actual.to(torch.float64)
    both_nan = e.isnan() & a.isnan()
    finite = e.isfinite() & a.isfinite()
    diff = (a - e).abs()
    if rule.kind == "float":
        atol, rtol = _tolerance(rule, expected.dtype)
        ok = (finite & (diff <= atol + rtol * e.abs())) | both_nan | (e == a)
    else:
        atol = rtol = None
        ok = (e == a) | both_nan if expected.is_floating_point() else expected == actual
    matched, total = int(ok.sum()), ok.numel()
    nans = {"unexpected_nan": int((a.isnan() & ~e.isnan()).sum()),
            "missing_nan": int((e.isnan() & ~a.isnan()).sum())}
    first = _first_mismatch(~ok, expected, actual) if matched != total else None
    return Comparison(
        passed=matched == total, reason=_element_reason(matched, total, nans, first),
        atol=atol, rtol=rtol, max_abs_error=_max_or_none(diff[finite]),
        max_rel_error=_max_or_none((diff / e.abs())[finite & (e != 0)]),
        matched=matched, total=total, matched_ratio=matched / total if total else 1.0,
        nonfinite=int((~ok & ~finite).sum()), first_mismatch=first, **nans, **base)


def _tolerance(rule: CompareRule, dtype: torch.dtype) -> tuple[float, float]:
    atol, rtol = default_tolerance(dtype)
    return (atol if rule.atol is None else rule.atol, rtol if rule.rtol is None else rule.rtol)


def _element_reason(matched: int, total: int, nans: dict[str, int],
                    first: str | None) -> str | None:
    if matched == total:
        return None
    notes = []
    if nans["unexpected_nan"]:
        notes.append(f"{nans['unexpected_nan']} NaN where none expected")
    if nans["missing_nan"]:
        notes.append(f"{nans['missing_nan']} number(s) where NaN expected")
    reason = f"{total - matched} of {total} elements differ"
    reason += f" ({'; '.join(notes)})" if notes else ""
    return reason + (f"; first at {first}" if first else "")


def _first_mismatch(bad: torch.Tensor, expected: torch.Tensor, actual: torch.Tensor) -> str:
    import torch

    flat = int(bad.reshape(-1).nonzero()[0, 0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), bad.shape)]
    want, got = expected.reshape(-1)[flat].item(), actual.reshape(-1)[flat].item()
    return f"{index}: expected {want:.6g}, got {got:.6g}"


def _max_or_none(values: torch.Tensor) -> float | None:
    return float(values.max()) if values.numel() else None


def _compare_selection(rule: CompareRule, expected: torch.Tensor, actual: torch.Tensor,
                       scores: torch.Tensor | None, base: dict[str, Any]) -> Comparison:
    import torch

    width = expected.shape[-1] if expected.dim() else 1
    e_rows, a_rows = expected.reshape(-1, width), actual.reshape(-1, width)
    row_scores, tol = None, None
    if scores is not None:
        lead = expected.dim() - 1
        if scores.dim() <= lead or tuple(scores.shape[:lead]) != tuple(expected.shape[:-1]):
            return Comparison(passed=False, total=e_rows.shape[0], matched_ratio=0.0, **base,
                              reason=f"scores shape {list(scores.shape)} does not align with "
                                     f"the rows of {list(expected.shape)}")
        row_scores = scores.reshape(e_rows.shape[0], -1).to(torch.float64).cpu()
        tol = rule.atol if rule.atol is not None else default_tolerance(scores.dtype)[0]
    # Rows whose sorted contents agree are equal as sets (padding included); only the
    # others need the per-row set logic below.
    same = (e_rows.sort(dim=-1).values == a_rows.sort(dim=-1).values).all(dim=-1)
    matched, ties = int(same.sum()), 0
    for row in (~same).nonzero().flatten().tolist():
        verdict = _row_verdict(e_rows[row].tolist(), a_rows[row].tolist(),
                               None if row_scores is None else row_scores[row], tol)
        matched += verdict != "differ"
        ties += verdict == "tie"
    total = e_rows.shape[0]
    reason = None if matched == total else f"{total - matched} of {total} rows select other indices"
    return Comparison(passed=matched == total, reason=reason, atol=tol, matched=matched,
                      total=total, matched_ratio=matched / total if total else 1.0, ties=ties,
                      **base)


def _row_verdict(expected: list[int], actual: list[int], scores: torch.Tensor | None,
                 tol: float | None) -> Literal["same", "tie", "differ"]:
    chosen = [i for i in actual if i != -1]
    want, got = {i for i in expected if i != -1}, set(chosen)
    if len(got) != len(chosen):
        return "differ"
    if want == got:
        return "same"
    missing, extra = want - got, got - want
    if scores is None or tol is None or len(missing) != len(extra):
        return "differ"
    width = scores.shape[0]
    if any(not 0 <= i < width for i in missing | extra):
        return "differ"
    lacked = sorted(float(scores[i]) for i in missing)
    instead = sorted(float(scores[i]) for i in extra)
    # A NaN difference (infinite scores) compares False: never a tie.
    return "tie" if all(abs(x - y) <= tol for x, y in zip(lacked, instead)) else "differ"
