"""The graphs mode's per-layer hash kernel (:func:`enginetap.tap.record.rowhash.hash_slots`)
computes the torch reference's hash into the right slots: on the CPU through Triton's
interpreter (CI); on CUDA the graphs tests check it inside captured graphs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the kernel is checked "
                    "on the device (tests/tap/test_tap_graphs_gpu.py)")
def test_per_layer_kernel_equals_the_reference_in_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("rowhash_checks.py"))],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rowhash kernels agree" in done.stdout
