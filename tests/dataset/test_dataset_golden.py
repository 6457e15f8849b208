"""Golden bytes: the on-disk format of a definition, a workload line and a blob is pinned.

A change here changes what flashinfer-bench and older enginetap versions read: update the
expected bytes only on purpose.
"""

from __future__ import annotations

import hashlib

import torch

from enginetap.dataset.schema import AxisConst, AxisVar, Definition, Receipt, TensorSpec

UUID = "0123456789abcdef0123456789abcdef"
BLOB = f"blob/workloads/tiny_scale/tiny_scale_h2/tiny_scale_h2_{UUID}.safetensors"

DEFINITION_JSON = """\
{
  "name": "tiny_scale_h2",
  "op_type": "tiny_scale",
  "axes": {
    "batch": {
      "type": "var",
      "description": "rows"
    },
    "hidden": {
      "type": "const",
      "value": 2,
      "description": null
    }
  },
  "inputs": {
    "x": {
      "shape": [
        "batch",
        "hidden"
      ],
      "dtype": "bfloat16",
      "description": null
    },
    "scale": {
      "shape": null,
      "dtype": "float32",
      "description": null
    }
  },
  "outputs": {
    "y": {
      "shape": [
        "batch",
        "hidden"
      ],
      "dtype": "bfloat16",
      "description": null
    }
  },
  "reference": "def run(x, scale):\\n    return x * scale\\n",
  "tags": [
    "golden"
  ],
  "description": "y = x * scale",
  "constraints": [
    "batch >= 1"
  ]
}
"""

WORKLOAD_LINE = (
    '{"definition":"tiny_scale_h2","workload":{"axes":{"batch":3},"inputs":{"x":{"type":'
    f'"safetensors","path":"{BLOB}","tensor_key":"x"}},"scale":{{"type":"scalar","value":2.0}}}},'
    f'"uuid":"{UUID}"}},"solution":null,"evaluation":null,"enginetap":{{"outputs":{{"tensors":'
    f'{{"y":{{"type":"safetensors","path":"{BLOB}","tensor_key":"enginetap_output:y"}}}}}},'
    '"receipt":{"source":"manual","created_at":"2026-01-02T03:04:05Z","engine":null,'
    '"engine_version":null,"model":"tiny","request_ids":[],"step":null,"mode":null,'
    '"layer":null,"rank":null,"world_size":null,"seed":null,"enginetap_version":null,'
    '"notes":{"k":1}}}}\n'
)

BLOB_SHA256 = "e260ff9ccc06b7b1c60f9481ee8cae9183eed3174fc06d651cf97e6ca1c1805d"


def test_on_disk_bytes_are_pinned(dataset):
    definition = Definition(
        name="tiny_scale_h2", op_type="tiny_scale", description="y = x * scale",
        axes={"batch": AxisVar(description="rows"), "hidden": AxisConst(value=2)},
        inputs={"x": TensorSpec(shape=["batch", "hidden"], dtype="bfloat16"),
                "scale": TensorSpec(shape=None, dtype="float32")},
        outputs={"y": TensorSpec(shape=["batch", "hidden"], dtype="bfloat16")},
        reference="def run(x, scale):\n    return x * scale\n",
        tags=["golden"], constraints=["batch >= 1"])
    # Exactly representable values, so the blob's bytes do not depend on rounding.
    x = torch.tensor([[0.5, -1.25], [3.0, 0.125], [2.5, -0.75]], dtype=torch.bfloat16)
    receipt = Receipt(source="manual", created_at="2026-01-02T03:04:05Z", model="tiny",
                      notes={"k": 1})
    dataset.add_workload(definition, {"x": x, "scale": 2}, outputs={"y": x * 2},
                         receipt=receipt, uuid=UUID)

    root = dataset.root
    assert (root / "definitions/tiny_scale/tiny_scale_h2.json").read_text() == DEFINITION_JSON
    assert (root / "workloads/tiny_scale/tiny_scale_h2.jsonl").read_text() == WORKLOAD_LINE
    assert hashlib.sha256((root / BLOB).read_bytes()).hexdigest() == BLOB_SHA256
