"""Grouped GEMM of FP8 activations with packed FP4 expert weights, output bf16.

Rows ``m_indptr[e]:m_indptr[e + 1]`` of ``a`` belong to expert ``e``; row ``r`` of expert
``e`` gives ``y[r] = A[r] @ W[e].T`` with, in float32:

* ``A[r, j] = float(a[r, j]) * a_scale[r, j // (k // k_blocks)]`` (FP8 e4m3fn codes with one
  float32 scale per row and per block of ``k // k_blocks`` columns; ``k_blocks == 1`` is a
  per-row scale, ``k_blocks == k // 128`` the 1x128 blocks of DeepSeek-style FP8).
* ``W[e, c, j] = e2m1(code) * 2 ** (w_scale[e, c, j // 32] - 127)``. Byte ``w[e, c, i]``
  packs two e2m1 codes: element ``2i`` in the low nibble (bits 0-3), element ``2i + 1`` in
  the high nibble (bits 4-7). A code is sign (bit 3), exponent (bits 2-1), mantissa (bit 0):
  magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. Scale bytes are E8M0 exponents read as unsigned
  (the int8 tensor holds the raw byte); byte 255 is NaN.
"""

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _fp4_decode(packed):
    """Packed int8 bytes ``[..., m]`` -> float32 values ``[..., 2 * m]`` (low nibble first)."""
    table = torch.tensor(E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES),
                         dtype=torch.float32, device=packed.device)
    byte = packed.to(torch.int32) & 0xFF
    pairs = torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1)
    return pairs.flatten(-2)


def _e8m0_decode(raw):
    exponent = (raw.to(torch.int32) & 0xFF).to(torch.float32)
    return torch.where(exponent == 255, torch.full_like(exponent, float("nan")),
                       torch.exp2(exponent - 127.0))


def _check(a, m_indptr):
    bounds = m_indptr.tolist()
    if len(bounds) != num_experts + 1 or bounds[0] != 0 or bounds[-1] != a.shape[0]:
        raise ValueError(f"m_indptr must hold num_experts + 1 = {num_experts + 1} offsets "
                         f"from 0 to total_m = {a.shape[0]}, got {bounds}")
    if any(hi < lo for lo, hi in zip(bounds, bounds[1:])):
        raise ValueError(f"m_indptr must not decrease, got {bounds}")
    if k % k_blocks or k_packed * 2 != k or k_groups * 32 != k:
        raise ValueError("axes must satisfy k % k_blocks == 0, k_packed * 2 == k, "
                         "k_groups * 32 == k")
    return bounds


def run(a, a_scale, w, w_scale, m_indptr):
    bounds = _check(a, m_indptr)
    block = k // k_blocks
    x = a.to(torch.float32) * a_scale.to(torch.float32).repeat_interleave(block, dim=-1)
    y = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    for expert in range(num_experts):
        lo, hi = bounds[expert], bounds[expert + 1]
        if hi == lo:
            continue
        # One expert at a time: dequantizing every expert at once needs E * n * k floats.
        weight = _fp4_decode(w[expert]) * _e8m0_decode(w_scale[expert]).repeat_interleave(32, -1)
        y[lo:hi] = x[lo:hi] @ weight.T
    return y.to(torch.bfloat16)
