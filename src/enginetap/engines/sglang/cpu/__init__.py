"""SGLang's CPU path without its kernel package: the ``sgl_kernel`` stand-in
(:mod:`.standin`), torch kernels (:mod:`.kernels`), the CPU-path fixes (:mod:`.fixes`) and
the torchvision op schemas (:mod:`.boot`). See docs/sglang.md."""
