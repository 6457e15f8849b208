"""The patching layer on real transformers functions and on fresh modules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import transformers.models.llama.modeling_llama as llama

from enginetap.core.patching import Patch, PatchSet, Target, bind_arguments
from enginetap.errors import PatchError

RMS = "transformers.models.llama.modeling_llama:LlamaRMSNorm.forward"


def _norm() -> tuple[llama.LlamaRMSNorm, torch.Tensor]:
    torch.manual_seed(0)
    norm = llama.LlamaRMSNorm(16)
    norm.weight.data.normal_(1.0, 0.1)
    return norm, torch.randn(3, 16)


def test_install_call_uninstall_restores_exact_original():
    original = vars(llama.LlamaRMSNorm)["forward"]
    norm, x = _norm()
    expected = norm(x)
    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append((instance, bind_arguments(wrapped, args, kwargs)["hidden_states"].shape))
        return wrapped(*args, **kwargs)

    patch = Patch(RMS, spy).install()
    assert patch.installed and patch.original is original
    assert vars(llama.LlamaRMSNorm)["forward"] is not original
    assert torch.equal(norm(x), expected)
    assert seen == [(norm, torch.Size([3, 16]))]
    patch.uninstall()
    assert vars(llama.LlamaRMSNorm)["forward"] is original
    assert torch.equal(norm(x), expected) and len(seen) == 1


def test_module_function_patch_and_restore():
    original = llama.rotate_half
    calls = []
    patch = Patch("transformers.models.llama.modeling_llama:rotate_half",
                  lambda w, i, a, k: calls.append(1) or w(*a, **k)).install()
    x = torch.randn(2, 8)
    assert torch.equal(llama.rotate_half(x), original(x)) and calls == [1]
    patch.uninstall()
    assert llama.rotate_half is original


@pytest.mark.parametrize("where", ["before", "after"])
def test_wrapper_error_is_contained_and_original_runs_once(where):
    norm, x = _norm()
    expected = norm(x)
    runs = []

    def broken(wrapped, instance, args, kwargs):
        if where == "before":
            raise RuntimeError("wrapper bug before the call")
        out = wrapped(*args, **kwargs)
        runs.append(1)
        raise RuntimeError("wrapper bug after the call")

    with PatchSet("t", [Patch(RMS, broken)]) as ps:
        out = norm(x)
        assert torch.equal(out, expected)
        errors = ps.errors()
    assert len(errors) == 1 and "wrapper bug" in errors[0].error
    assert runs == ([] if where == "before" else [1])


def test_engine_exception_propagates_unchanged():
    norm, _ = _norm()

    def passthrough(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    with PatchSet("t", [Patch(RMS, passthrough)]) as ps:
        with pytest.raises(RuntimeError) as info:
            norm(torch.randn(3, 7))  # wrong hidden size: the engine's own error
        assert ps.errors() == []
    assert "size" in str(info.value)


def test_descriptors_and_inherited_attributes_restore(tmp_path, monkeypatch):
    (tmp_path / "et_fixture_mod.py").write_text(textwrap.dedent("""
        class Base:
            def inherited(self, x):
                return x + 1
        class Child(Base):
            @staticmethod
            def smethod(x):
                return x * 2
            @classmethod
            def cmethod(cls, x):
                return (cls.__name__, x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import et_fixture_mod as mod

    raw_static = vars(mod.Child)["smethod"]
    raw_class = vars(mod.Child)["cmethod"]
    add10 = lambda w, i, a, k: w(*a, **k) + 10  # noqa: E731
    tag = lambda w, i, a, k: ("patched", w(*a, **k))  # noqa: E731
    patches = PatchSet("d")
    patches.add("et_fixture_mod:Child.smethod", add10)
    patches.add("et_fixture_mod:Child.cmethod", tag)
    patches.add("et_fixture_mod:Child.inherited", add10)
    with patches:
        assert mod.Child.smethod(3) == 16 and mod.Child().smethod(3) == 16
        assert mod.Child.cmethod(1) == ("patched", ("Child", 1))
        assert mod.Child().inherited(1) == 12 and mod.Base().inherited(1) == 2
    assert vars(mod.Child)["smethod"] is raw_static and vars(mod.Child)["cmethod"] is raw_class
    assert "inherited" not in vars(mod.Child) and mod.Child().inherited(1) == 2


def test_post_import_hook_lands_before_from_import_copies():
    # A fresh interpreter, so the target module is not imported yet.
    code = textwrap.dedent("""
        import sys
        from enginetap.core.patching import Patch
        name = "transformers.models.qwen3.modeling_qwen3"
        assert name not in sys.modules
        p = Patch(name + ":rotate_half", lambda w, i, a, k: "patched").install()
        assert p.pending and not p.installed
        from transformers.models.qwen3.modeling_qwen3 import rotate_half
        assert p.installed
        print(rotate_half(None))
        original = p.original
        p.uninstall()
        import transformers.models.qwen3.modeling_qwen3 as m
        assert m.rotate_half is original
        print(type(m.rotate_half).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["patched", "function"]


def test_pending_patch_cancelled_by_uninstall():
    code = textwrap.dedent("""
        from enginetap.core.patching import Patch
        p = Patch("transformers.models.mistral.modeling_mistral:rotate_half",
                  lambda w, i, a, k: "patched").install()
        p.uninstall()
        from transformers.models.mistral.modeling_mistral import rotate_half
        print(type(rotate_half).__name__, p.installed)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["function", "False"]


@pytest.mark.parametrize("spec", ["nocolon", "mod:", ":attr", "mod:a..b", "a:b:c."])
def test_bad_targets_are_refused_with_a_fix(spec):
    with pytest.raises(PatchError) as info:
        Target.parse(spec)
    assert "Fix:" in str(info.value)


def test_unresolvable_target_rolls_back_the_set():
    original = vars(llama.LlamaRMSNorm)["forward"]
    ps = PatchSet("t")
    ps.add(RMS, lambda w, i, a, k: w(*a, **k))
    ps.add("transformers.models.llama.modeling_llama:LlamaRMSNorm.no_such_method",
           lambda w, i, a, k: w(*a, **k))
    with pytest.raises(PatchError, match="no_such_method"):
        ps.install()
    assert vars(llama.LlamaRMSNorm)["forward"] is original


def test_bind_arguments_names_and_defaults():
    bound = bind_arguments(llama.apply_rotary_pos_emb, (1, 2, 3, 4), {})
    assert bound == {"q": 1, "k": 2, "cos": 3, "sin": 4, "unsqueeze_dim": 1}


def test_bind_arguments_fast_path_says_what_signature_bind_says():
    # the fast path (plain signatures) against inspect's own binding: same names, order,
    # defaults, and a TypeError wherever bind raises one
    import inspect

    def plain(a, b, /, c, d=4, *, e, f=6):
        return None

    def spread(a, *rest, b=2, **extra):
        return None

    class Holder:
        def method(self, x, y=2):
            return None

    calls = [(plain, (1, 2, 3), {"e": 5}), (plain, (1, 2), {"c": 3, "e": 5, "f": 7}),
             (plain, (1, 2, 3, 4), {"e": 5}), (plain, (1,), {"b": 2, "c": 3, "e": 5}),
             (plain, (1, 2, 3), {}), (plain, (1, 2, 3, 4, 5), {"e": 5}),
             (plain, (1, 2, 3), {"c": 3, "e": 5}), (plain, (1, 2, 3), {"e": 5, "g": 0}),
             (spread, (1, 2, 3), {"z": 0}), (spread, (), {}),
             (Holder().method, (1,), {}), (Holder().method, (), {"y": 3, "x": 1}),
             (Holder.method, (Holder(), 1), {})]
    for function, args, kwargs in calls:
        try:
            bound = inspect.signature(function).bind(*args, **kwargs)
        except TypeError:
            with pytest.raises(TypeError):
                bind_arguments(function, args, kwargs)
            continue
        bound.apply_defaults()
        got = bind_arguments(function, args, kwargs)
        assert got == dict(bound.arguments) and list(got) == list(bound.arguments)


def test_errors_meant_for_the_caller_pass_through():
    from enginetap.core.patching import ReachesCaller

    class Refused(ReachesCaller):
        pass

    norm, x = _norm()

    def refuse(wrapped, instance, args, kwargs):
        raise Refused("stop the run")

    with PatchSet("t", [Patch(RMS, refuse)]) as ps:
        with pytest.raises(Refused, match="stop the run"):
            norm(x)
        assert ps.errors() == []


def test_a_shut_gate_calls_the_original_and_an_open_one_the_wrapper():
    from enginetap.core.patching import Gate

    norm, x = _norm()
    expected = norm(x)
    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append(instance)
        return wrapped(*args, **kwargs)

    gate = Gate(is_open=False)
    with PatchSet("t", [Patch(Target.parse(RMS), spy, gate)]):
        assert torch.equal(norm(x), expected) and seen == []  # shut: the wrapper never ran
        gate.set(True)
        assert torch.equal(norm(x), expected) and seen == [norm]
        gate.set(False)
        norm(x)
        assert seen == [norm]
    norm(x)  # uninstalled: the class holds the original again
    assert seen == [norm] and not hasattr(vars(llama.LlamaRMSNorm)["forward"], "__wrapped__")


@pytest.fixture
def fresh():
    """A fresh module ``_et_fresh`` holding a class ``Box`` (``forward`` doubles) and a
    function ``f``; removed from ``sys.modules`` after the test."""
    import types

    module = types.ModuleType("_et_fresh")

    class Box(torch.nn.Module):
        def forward(self, x):
            return x * 2

    def f(x):
        return x + 1

    module.Box, module.f = Box, f  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _spy(seen: list, label: str):
    def spy(wrapped, instance, args, kwargs):
        seen.append(label)
        return wrapped(*args, **kwargs)

    return spy


def test_a_detach_gate_puts_the_original_back_on_the_class_while_shut(fresh):
    from enginetap.core.patching import Gate

    module = fresh
    box, original = module.Box(), vars(module.Box)["forward"]
    seen: list[str] = []
    gate = Gate(is_open=False, detach=True)
    patch = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "ours"),
                  gate).install()
    # installed under a shut gate: the class holds the engine's own function
    assert patch.installed and not patch.attached
    assert vars(module.Box)["forward"] is original
    assert torch.equal(box(torch.ones(2)), torch.full((2,), 2.0)) and seen == []
    gate.set(True)
    assert patch.attached and vars(module.Box)["forward"] is not original
    box(torch.ones(2))
    assert seen == ["ours"]
    gate.set(False)
    assert vars(module.Box)["forward"] is original and not patch.attached
    box(torch.ones(2))
    assert seen == ["ours"]
    gate.set(True)
    patch.uninstall()  # attached: the original is restored
    assert vars(module.Box)["forward"] is original and not gate._patches


def test_a_detach_gate_leaves_module_functions_and_inherited_methods_right(fresh):
    """A module function stays wrapped (a ``from m import f`` copy must see the wrapper),
    gated as before; a method the class inherits comes off as a deletion."""
    from enginetap.core.patching import Gate

    module = fresh

    class Child(module.Box):
        pass

    module.Child = Child
    seen: list[str] = []
    gate = Gate(is_open=False, detach=True)
    function = Patch(Target.parse(f"{module.__name__}:f"), _spy(seen, "f"), gate).install()
    inherited = Patch(Target.parse(f"{module.__name__}:Child.forward"), _spy(seen, "child"),
                      gate).install()
    assert function.attached and hasattr(module.f, "__wrapped__")
    assert not inherited.attached and "forward" not in vars(Child)
    module.f(1)
    Child()(torch.ones(1))
    assert seen == []
    gate.set(True)
    module.f(1)
    Child()(torch.ones(1))
    assert seen == ["f", "child"] and "forward" in vars(Child)
    gate.set(False)
    assert "forward" not in vars(Child) and function.attached
    function.uninstall()
    inherited.uninstall()
    assert not hasattr(module.f, "__wrapped__") and "forward" not in vars(Child)


def test_a_patch_stacked_on_a_detachable_one_pins_it_and_both_come_off_in_order(fresh):
    from enginetap.core.patching import Gate

    module = fresh
    box, original = module.Box(), vars(module.Box)["forward"]
    seen: list[str] = []
    gate = Gate(is_open=False, detach=True)
    below = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "below"),
                  gate).install()
    assert not below.attached
    above = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "above")).install()
    assert below.attached and above.original is below._installed_wrapper
    box(torch.ones(1))
    assert seen == ["above"]  # below's gate is shut: its wrapper is skipped
    gate.set(True)
    gate.set(False)  # pinned: no swap may take below out from under above
    assert vars(module.Box)["forward"] is above._installed_wrapper
    gate.set(True)
    box(torch.ones(1))
    assert seen == ["above", "above", "below"]
    above.uninstall()
    below.uninstall()
    assert vars(module.Box)["forward"] is original


def test_detach_patches_stacked_on_one_method_put_the_highest_open_one_on_the_class(fresh):
    from enginetap.core.patching import Gate

    module = fresh
    box, original = module.Box(), vars(module.Box)["forward"]
    seen: list[str] = []
    low, high = Gate(is_open=False, detach=True), Gate(is_open=False, detach=True)
    first = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "low"),
                  low).install()
    second = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "high"),
                   high).install()
    assert second.original is first._installed_wrapper  # stacked in install order
    assert vars(module.Box)["forward"] is original
    assert not first.attached and not second.attached
    for low_open, high_open, expect in ((True, False, ["low"]), (False, True, ["high"]),
                                        (True, True, ["high", "low"]),
                                        (False, False, [])):
        low.set(low_open)
        high.set(high_open)
        seen.clear()
        assert torch.equal(box(torch.ones(1)), torch.full((1,), 2.0))
        assert seen == expect, (low_open, high_open)
        held = vars(module.Box)["forward"]
        assert held is (second._installed_wrapper if high_open else
                        first._installed_wrapper if low_open else original)
        assert first.attached == (low_open or high_open) and second.attached == high_open
    low.set(True)
    second.uninstall()
    first.uninstall()
    assert vars(module.Box)["forward"] is original and not low._patches


def test_a_detached_patch_wraps_a_replacement_made_while_off_and_leaves_it(fresh):
    from enginetap.core.patching import Gate

    module = fresh
    seen: list[str] = []
    gate = Gate(is_open=False, detach=True)

    def replacement(self, x):
        seen.append("replacement")
        return x * 3

    patch = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "ours"),
                  gate).install()
    module.Box.forward = replacement  # someone else's monkeypatch, while we are off
    gate.set(True)
    assert torch.equal(module.Box()(torch.ones(1)), torch.full((1,), 3.0))
    assert seen == ["ours", "replacement"]
    gate.set(False)  # wrapped for good now: gated, not detached
    assert patch.attached
    module.Box()(torch.ones(1))
    assert seen == ["ours", "replacement", "replacement"]
    patch.uninstall()
    assert vars(module.Box)["forward"] is replacement


def test_a_foreign_wrapper_stacked_on_an_attached_chain_stays_and_pins_it(fresh):
    """Someone wraps the class's method while our patch is on: at the next swap the chain
    is left as it is (no second copy of our wrapper), gated from then on."""
    import functools

    from enginetap.core.patching import Gate

    module = fresh
    seen: list[str] = []
    gate = Gate(is_open=True, detach=True)
    patch = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "ours"),
                  gate).install()
    inner = vars(module.Box)["forward"]

    @functools.wraps(inner)
    def theirs(self, x):
        seen.append("theirs")
        return inner(self, x)

    module.Box.forward = theirs
    gate.set(False)
    assert vars(module.Box)["forward"] is theirs and patch.attached
    module.Box()(torch.ones(1))
    assert seen == ["theirs"]  # ours is gated shut
    gate.set(True)
    module.Box()(torch.ones(1))
    assert seen == ["theirs", "theirs", "ours"]  # ours once, not wrapped again
    patch.uninstall()
    assert vars(module.Box)["forward"] is theirs


def test_a_detach_patch_installed_on_a_pinned_chain_is_wrapped_once(fresh):
    from enginetap.core.patching import Gate

    module = fresh
    seen: list[str] = []
    first, second = Gate(is_open=False, detach=True), Gate(is_open=False, detach=True)
    original = vars(module.Box)["forward"]
    low = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "low"),
                first).install()
    plain = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "plain")).install()
    high = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy(seen, "high"),
                 second).install()
    assert high.original is plain._installed_wrapper and low.attached and high.attached
    first.set(True)
    second.set(True)
    module.Box()(torch.ones(1))
    assert seen == ["high", "plain", "low"]
    for patch in (high, plain, low):
        patch.uninstall()
    assert vars(module.Box)["forward"] is original


def test_uninstall_leaves_a_wrapper_someone_stacked_on_ours(fresh):
    module = fresh
    ours = Patch(Target.parse(f"{module.__name__}:Box.forward"), _spy([], "ours")).install()
    theirs = object.__new__(type("Theirs", (), {"__call__": lambda self, *a: None}))
    module.Box.forward = theirs
    ours.uninstall()
    assert vars(module.Box)["forward"] is theirs


def test_a_contained_wrapper_is_installed_without_the_containment_layer():
    """A wrapper marked ``contained`` handles its own errors: the patch installs it as it
    is, so an error it lets out reaches the caller; an unmarked one is contained."""
    from enginetap.core.patching import contained

    norm, x = _norm()
    expected = norm(x)

    def broken(wrapped, instance, args, kwargs):
        raise RuntimeError("the wrapper's own bug")

    with PatchSet("plain", [Patch(RMS, broken)]) as patches:
        assert torch.equal(norm(x), expected)  # contained: the original ran
        assert len(patches.errors()) == 1
    with PatchSet("marked", [Patch(RMS, contained(broken))]) as patches:
        with pytest.raises(RuntimeError, match="own bug"):
            norm(x)
        assert patches.errors() == []
