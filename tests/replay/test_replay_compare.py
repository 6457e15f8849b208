"""compare_outputs: float tolerances per dtype, NaN/inf, exact, selection with ties."""

from __future__ import annotations

import pytest
import torch

from enginetap.definitions.base import CompareRule
from enginetap.replay.compare import compare_outputs, default_tolerance, fallback_rule

FLOAT = CompareRule(kind="float")
EXACT = CompareRule(kind="exact")


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) + 3.0).to(dtype)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 1e-3),
                                            (torch.bfloat16, 1e-2)])
def test_float_default_tolerance_per_dtype(dtype: torch.dtype, tol: float) -> None:
    assert default_tolerance(dtype) == (tol, tol)
    expected = _randn(64, 32, dtype=dtype)
    # Values near 3 in every format: one element moved by 20x the allowed error fails,
    # everything else (identical) passes.
    actual = expected.clone()
    actual[5, 7] = (actual[5, 7].double() + 20 * tol * 4).to(dtype)
    result = compare_outputs(FLOAT, expected, actual)
    assert not result.passed
    assert (result.atol, result.rtol) == (tol, tol)
    assert result.matched == 64 * 32 - 1 and result.total == 64 * 32
    moved = (actual[5, 7].double() - expected[5, 7].double()).abs().item()
    assert result.max_abs_error == pytest.approx(moved)
    assert result.max_rel_error == pytest.approx(moved / expected[5, 7].double().abs().item())
    assert result.reason.startswith("1 of 2048 elements differ; first at [5, 7]: expected ")
    assert compare_outputs(FLOAT, expected, expected.clone()).passed


def test_float_within_tolerance_passes_and_rule_overrides_defaults() -> None:
    expected = _randn(100, dtype=torch.float32)
    actual = expected + 5e-4  # within atol + rtol*|e| for rtol 1e-3, not for fp32 defaults
    assert not compare_outputs(FLOAT, expected, actual).passed
    loose = compare_outputs(CompareRule(kind="float", atol=1e-3, rtol=0.0), expected, actual)
    assert loose.passed and loose.matched_ratio == 1.0
    assert loose.max_abs_error == pytest.approx(5e-4, rel=1e-3)


def test_nan_matches_only_nan_and_unexpected_nan_fails() -> None:
    expected = _randn(10)
    expected[2] = float("nan")
    actual = expected.clone()
    assert compare_outputs(FLOAT, expected, actual).passed  # NaN where the reference has NaN
    actual[4] = float("nan")
    result = compare_outputs(FLOAT, expected, actual)
    assert not result.passed and result.unexpected_nan == 1
    assert result.reason.startswith("1 of 10 elements differ (1 NaN where none expected); "
                                    "first at [4]: expected ")
    actual = expected.clone()
    actual[2] = 1.0  # a number where the reference has NaN
    assert compare_outputs(FLOAT, expected, actual).matched == 9


def test_infinities_match_only_the_same_infinity() -> None:
    expected = torch.tensor([float("inf"), -float("inf"), 1.0])
    assert compare_outputs(FLOAT, expected, expected.clone()).passed
    flipped = torch.tensor([float("inf"), float("inf"), 1.0])
    result = compare_outputs(FLOAT, expected, flipped)
    assert result.matched == 2 and result.max_abs_error == 0.0


def test_structure_mismatch_fails_without_numbers() -> None:
    expected = _randn(4, 8, dtype=torch.bfloat16)
    shape = compare_outputs(FLOAT, expected, _randn(4, 9, dtype=torch.bfloat16))
    assert not shape.passed and shape.reason == "shape [4, 9], expected [4, 8]"
    dtype = compare_outputs(FLOAT, expected, expected.float())
    assert not dtype.passed and dtype.reason == "dtype float32, expected bfloat16"
    assert dtype.max_abs_error is None


def test_exact_integers_and_fallback_rules() -> None:
    gen = torch.Generator().manual_seed(1)
    expected = torch.randint(0, 1000, (6, 5), generator=gen, dtype=torch.int32)
    assert compare_outputs(EXACT, expected, expected.clone()).passed
    actual = expected.clone()
    actual[1, 1] += 7
    result = compare_outputs(EXACT, expected, actual)
    assert not result.passed and result.matched == 29 and result.max_abs_error == 7.0
    assert fallback_rule(torch.int64).kind == "exact"
    assert fallback_rule(torch.bool).kind == "exact"
    assert fallback_rule(torch.bfloat16).kind == "float"


def test_exact_floats_treat_equal_nans_as_equal() -> None:
    expected = _randn(5)
    expected[0] = float("nan")
    assert compare_outputs(EXACT, expected, expected.clone()).passed
    nudged = expected.clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(10.0))
    assert not compare_outputs(EXACT, expected, nudged).passed


SELECT = CompareRule(kind="selection")


def test_selection_compares_rows_as_sets_ignoring_order_and_padding() -> None:
    expected = torch.tensor([[3, 1, 2, -1], [0, 5, 6, 7]])
    actual = torch.tensor([[2, 3, -1, 1], [7, 6, 5, 0]])
    result = compare_outputs(SELECT, expected, actual)
    assert result.passed and result.matched == 2 and result.total == 2
    other = torch.tensor([[2, 3, -1, 4], [7, 6, 5, 0]])
    result = compare_outputs(SELECT, expected, other)
    assert not result.passed and result.reason == "1 of 2 rows select other indices"


def test_selection_rejects_repeated_indices() -> None:
    expected = torch.tensor([[1, 2, 3]])
    assert not compare_outputs(SELECT, expected, torch.tensor([[1, 2, 2]])).passed


def _scores() -> torch.Tensor:
    # Row 0: indices 2 and 5 tie exactly at 0.9; row 1: no ties.
    scores = torch.linspace(0.0, 0.7, 16).reshape(2, 8).clone()
    scores[0, 2] = scores[0, 5] = 0.9
    scores[0, 7] = 0.95
    return scores


def test_selection_accepts_a_differing_index_whose_score_ties() -> None:
    scores = _scores()
    rule = CompareRule(kind="selection", scores="scores")
    expected = torch.tensor([[7, 2], [7, 6]])
    tie = torch.tensor([[5, 7], [6, 7]])  # 5 instead of 2: same score
    result = compare_outputs(rule, expected, tie, scores=scores)
    assert result.passed and result.ties == 1 and result.atol == 1e-5
    # Without the scores the same rows differ.
    assert not compare_outputs(SELECT, expected, tie).passed


def test_selection_rejects_a_differing_index_whose_score_does_not_tie() -> None:
    scores = _scores()
    rule = CompareRule(kind="selection", scores="scores")
    expected = torch.tensor([[7, 2], [7, 6]])
    worse = torch.tensor([[7, 4], [7, 6]])  # 4 scores lower than 2
    result = compare_outputs(rule, expected, worse, scores=scores)
    assert not result.passed and result.ties == 0 and result.matched == 1
    gap = float(scores[0, 2] - scores[0, 4])
    wide = CompareRule(kind="selection", scores="scores", atol=gap + 1e-6)
    assert compare_outputs(wide, expected, worse, scores=scores).passed


def test_selection_with_misaligned_scores_fails_clearly() -> None:
    rule = CompareRule(kind="selection", scores="scores")
    expected = torch.tensor([[1, 2], [3, 4]])
    result = compare_outputs(rule, expected, expected.clone(), scores=torch.rand(3, 8))
    assert not result.passed
    assert result.reason == "scores shape [3, 8] does not align with the rows of [2, 2]"


def test_selection_scores_with_several_trailing_dims_are_flattened() -> None:
    # Scores laid out [rows, pages, slots]: id = page * slots + slot.
    scores = torch.arange(12, dtype=torch.float32).reshape(1, 3, 4).clone()
    scores[0, 2, 3] = scores[0, 1, 1]  # ids 11 and 5 tie
    rule = CompareRule(kind="selection", scores="scores")
    expected, tie = torch.tensor([[10, 5, -1]]), torch.tensor([[11, 10, -1]])
    assert compare_outputs(rule, expected, tie, scores=scores).ties == 1
    assert not compare_outputs(rule, expected, torch.tensor([[10, 4, -1]]), scores=scores).passed


def test_packed_fp4_is_compared_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 256, (4, 8), generator=gen, dtype=torch.uint8)
    expected = raw.view(torch.float4_e2m1fn_x2)
    same = compare_outputs(FLOAT, expected, raw.clone().view(torch.float4_e2m1fn_x2))
    assert same.passed and same.kind == "exact" and same.dtype == "float4_e2m1fn_x2"
    flipped = raw.clone()
    flipped[2, 3] ^= 0x10
    result = compare_outputs(FLOAT, expected, flipped.view(torch.float4_e2m1fn_x2))
    assert not result.passed and result.matched == 31
def test_paired_weights_follow_their_ids_in_any_row_order():
    import torch

    from enginetap.definitions.base import CompareRule
    from enginetap.replay.compare import compare_outputs

    rule = CompareRule(atol=1e-6, rtol=1e-5, paired_with="topk_ids")
    ids = torch.tensor([[3, 1, 6], [0, 2, 5]], dtype=torch.int32)
    weights = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.25, 0.15]])
    perm = torch.tensor([[2, 0, 1], [1, 2, 0]])
    engine_ids, engine_weights = ids.gather(1, perm), weights.gather(1, perm)
    assert not compare_outputs(rule, weights, engine_weights).passed  # unpaired: positions differ
    paired = compare_outputs(rule, weights, engine_weights, pairs=(ids, engine_ids))
    assert paired.passed and paired.matched_ratio == 1.0
    # Same weights, but bound to the wrong experts: must fail.
    swapped = engine_weights.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    assert not compare_outputs(rule, weights, swapped, pairs=(ids, engine_ids)).passed
