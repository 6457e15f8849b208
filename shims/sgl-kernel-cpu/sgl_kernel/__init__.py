"""enginetap's CPU stand-in for SGLang's kernel package (there is no CPU build of it on the
registry). Everything lives in :mod:`enginetap.engines.sglang.cpu.standin`: names that
raise a clear error when called, and torch implementations of the gated-delta and
causal-conv kernels SGLang's CPU path calls unconditionally (``sgl_kernel.mamba``)."""

from enginetap.engines.sglang.cpu.standin import fill_package as _fill

_fill(__name__)
del _fill
