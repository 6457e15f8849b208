"""Emulating another CPU's vLLM kernel paths (see test_cpu_paths.py).

With ``ENGINETAP_TEST_CPU_PATH`` set to ``avx2`` or ``avx512``, the CPU probes vLLM reads to
choose its build (``vllm._C`` for AVX512-BF16, ``vllm._C_AVX512``, ``vllm._C_AVX2``) and its
kernels (AMX tiles) report that CPU's features, before any test module imports vLLM. The
instructions then run are exactly that build's, as on a machine of that kind.
"""

from __future__ import annotations

import os

import torch

CPU_PATH_VAR = "ENGINETAP_TEST_CPU_PATH"
PATHS = {"avx2": (False, False), "avx512": (True, False)}
"""Path -> (AVX-512 supported, AVX512-BF16 supported); AMX is off on both."""

_path = os.environ.get(CPU_PATH_VAR)
if _path in PATHS:
    _avx512, _bf16 = PATHS[_path]
    torch.cpu._is_avx512_supported = lambda: _avx512
    torch.cpu._is_avx512_bf16_supported = lambda: _bf16
    torch.cpu._is_amx_tile_supported = lambda: False
