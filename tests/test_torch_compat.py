"""Each private torch name minitrain uses (``minitrain._torch``), on the installed torch.

One test per name, called ``test_<name>``: the name exists and does what minitrain relies on.
A torch release that moves, renames or changes one of them fails here by name.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import re
import types
from pathlib import Path

import pytest
import torch

from minitrain import _torch

# An op with a CPU kernel and no fake-tensor kernel (for UnsupportedOperatorException).
_LIB = torch.library.Library("minitrain_compat_test", "DEF")
_LIB.define("no_fake(Tensor x) -> Tensor")
_LIB.impl("no_fake", lambda x: x.clone(), "CPU")


def test_every_name_has_its_test_and_is_listed():
    names = set(_torch.__all__)
    bound = {  # modules other than torch's own (torch itself, an import hook's) are not names
        name for name, value in vars(_torch).items()
        if not name.startswith("_") and name != "annotations"
        and not (isinstance(value, types.ModuleType) and not value.__name__.startswith("torch."))
    }
    assert bound == names, f"public names of minitrain._torch not in __all__: {bound - names}"
    tests = {name for name, value in globals().items() if inspect.isfunction(value)}
    missing = sorted(name for name in names if f"test_{name}" not in tests)
    assert not missing, f"write test_<name> in tests/test_torch_compat.py for: {missing}"


def test_pyproject_lower_bound_is_the_oldest_torch_ci_tests():
    root = Path(__file__).resolve().parents[1]
    bound = re.search(r'"torch>=([0-9.]+)"', (root / "pyproject.toml").read_text()).group(1)
    pinned = re.findall(r'"torch==([0-9.]+)"', (root / ".ci" / "run").read_text())
    assert pinned and all(version.startswith(bound + ".") for version in pinned), (bound, pinned)
    assert f"torch>={bound}" in (root / "README.md").read_text()


# -- pytrees --------------------------------------------------------------------------------------


def test_pytree():
    pt = _torch.pytree
    point = collections.namedtuple("point", "x y")
    tree = {"b": [torch.ones(1), (torch.zeros(2),)], "a": point(torch.ones(3), 4.0)}
    leaves, spec = pt.tree_flatten(tree)
    assert [getattr(x, "shape", x) for x in leaves] == [(1,), (2,), (3,), 4.0]  # dict order kept
    assert pt.tree_leaves(tree) == leaves
    assert isinstance(spec, pt.TreeSpec) and pt.tree_structure(tree) == spec
    rebuilt = pt.tree_unflatten(leaves, spec)
    assert type(rebuilt["a"]) is point and rebuilt["b"][1][0] is leaves[1]
    doubled = pt.tree_map(lambda x: x * 2, tree)
    assert doubled["a"].y == 8.0 and torch.equal(doubled["b"][0], torch.full((1,), 2.0))
    assert pt.tree_map(lambda x, y: x + y, [1, 2], [10, 20]) == [11, 22]
    assert pt.tree_map(lambda s: "leaf", {"a": (1, 2)}, is_leaf=lambda x: isinstance(x, tuple)) == {
        "a": "leaf"
    }
    flat, _ = pt.tree_flatten_with_path(tree)  # key paths name the leaves flatten gives
    assert [x for _, x in flat] == leaves and pt.tree_leaves([None, 1]) == [None, 1]
    paths = [path for path, _ in flat]
    assert paths[0] == (pt.MappingKey("b"), pt.SequenceKey(0))
    assert paths[3] == (pt.MappingKey("a"), pt.GetAttrKey("y"))
    assert (paths[0][0].key, paths[0][1].idx, paths[3][1].name) == ("b", 0, "y")
    named = pt.tree_map_with_path(lambda path, x: len(path), {"a": [1, 2]})
    assert named == {"a": [2, 2]}


def test_pytree_of_a_node_type_the_python_registry_alone_holds():
    """A dataclass registered the public way (torch.export.register_dataclass, which fills the
    Python registry alone) flattens into its fields, as before optree did the flattening; a
    tree without one keeps the optree twins."""
    pt = _torch.pytree

    @dataclasses.dataclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor

    torch.export.register_dataclass(Pair)
    try:
        pair = Pair(torch.ones(1), torch.zeros(2))
        leaves, spec = pt.tree_flatten({"p": pair})
        assert [t.shape for t in leaves] == [(1,), (2,)] and pt.tree_leaves(pair) == leaves
        assert pt.tree_unflatten(leaves, spec)["p"] == pair and isinstance(spec, pt.TreeSpec)
        assert pt.tree_map(lambda t: t + 1, pair).a == 2
        fast = pt.tree_flatten({"p": torch.ones(1)})[1]
        assert isinstance(fast, torch.utils._cxx_pytree.TreeSpec)
    finally:
        torch.utils._pytree._deregister_pytree_node(Pair)


# -- dispatch modes and fake tensors --------------------------------------------------------------


class _Seen(_torch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, _torch.current_autograd_node() is not None))
        return func(*args, **(kwargs or {}))


def test_TorchDispatchMode():
    with _Seen() as seen:
        y = torch.ones(2, 3) @ torch.ones(3, 4)
    assert torch.equal(y, torch.full((2, 4), 3.0))
    assert torch.ops.aten.mm.default in [func for func, _ in seen.ops]
    assert all(type(func) is type(torch.ops.aten.mm.default) for func, _ in seen.ops)


def test_disable_current_modes():
    with _Seen() as seen:
        with _torch.disable_current_modes():
            torch.ones(2).sum()
        assert seen.ops == []
        torch.ones(2).sum()
    assert seen.ops


def test_FakeTensor():
    with _torch.FakeTensorMode():
        x = torch.empty(4096, 4096)
        y = x @ x
    assert isinstance(y, _torch.FakeTensor)
    assert (y.shape, y.dtype, y.device) == ((4096, 4096), torch.float32, torch.device("cpu"))
    assert isinstance(y.fake_mode, _torch.FakeTensorMode)


def test_FakeTensorMode():
    mode = _torch.FakeTensorMode(allow_non_fake_inputs=True)
    real = torch.ones(3, 2)
    with mode:
        fake = mode.from_tensor(torch.ones(8, 3))
        out = fake @ real  # a real input is allowed and treated as fake
    assert isinstance(out, _torch.FakeTensor) and out.shape == (8, 2) and out.fake_mode is mode


def test_DataDependentOutputException():
    with _torch.FakeTensorMode(), pytest.raises(_torch.DataDependentOutputException) as info:
        torch.ones(3).sum().item()
    assert "_local_scalar_dense" in str(info.value.func)


def test_DynamicOutputShapeException():
    with _torch.FakeTensorMode(), pytest.raises(_torch.DynamicOutputShapeException) as info:
        torch.nonzero(torch.ones(3))
    assert info.value.func is torch.ops.aten.nonzero.default


def test_UnsupportedOperatorException():
    assert torch.equal(torch.ops.minitrain_compat_test.no_fake(torch.ones(2)), torch.ones(2))
    with _torch.FakeTensorMode(), pytest.raises(_torch.UnsupportedOperatorException) as info:
        torch.ops.minitrain_compat_test.no_fake(torch.ones(2))
    assert info.value.func is torch.ops.minitrain_compat_test.no_fake.default


# -- autograd and torch.func internals ------------------------------------------------------------


def _exp_sum_with_hooks(w: torch.Tensor, packed: list) -> torch.Tensor:
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        return w.exp().sum()


def test_saved_tensors_hooks_enable():
    packed: list = []
    with pytest.raises(RuntimeError, match="saved tensor hooks"):
        torch.func.grad(lambda w: _exp_sum_with_hooks(w, packed))(torch.ones(2))

    def allowed(w):
        _torch.saved_tensors_hooks_enable()
        return _exp_sum_with_hooks(w, packed)

    assert torch.allclose(torch.func.grad(allowed)(torch.ones(2)), torch.ones(2).exp())
    assert packed  # the hook ran inside the transform
    with pytest.raises(RuntimeError, match="saved tensor hooks"):  # refused again afterwards
        torch.func.grad(lambda w: _exp_sum_with_hooks(w, packed))(torch.ones(2))


def test_peek_interpreter_stack():
    assert _torch.peek_interpreter_stack() is None
    inside = []
    torch.func.vmap(lambda t: inside.append(_torch.peek_interpreter_stack()) or t)(torch.ones(3))
    torch.func.grad(lambda t: inside.append(_torch.peek_interpreter_stack()) or t.sum())(
        torch.ones(3)
    )
    assert len(inside) == 2 and all(level is not None for level in inside)
    assert _torch.peek_interpreter_stack() is None


def test_vmap_transform():
    keys = []
    torch.func.vmap(lambda t: keys.append(_torch.peek_interpreter_stack().key()) or t)(
        torch.ones(3))
    torch.func.grad(lambda t: keys.append(_torch.peek_interpreter_stack().key()) or t.sum())(
        torch.ones(3))
    assert keys[0] == _torch.vmap_transform and keys[1] != _torch.vmap_transform


def test_unwrap_batched():
    stacked = torch.arange(6.0).reshape(2, 3)
    found = []

    def inner(t):
        found.append(_torch.unwrap_batched(t, _torch.peek_interpreter_stack().level()))
        return t

    torch.func.vmap(inner, in_dims=1)(stacked)
    inner_tensor, dim = found[0]
    assert dim == 1 and torch.equal(inner_tensor, stacked)


def test_add_batch_dim():
    def inner(t):  # a plain (3,) tensor made member-batched: each member sees its element
        level = _torch.peek_interpreter_stack().level()
        return t + _torch.add_batch_dim(torch.tensor([10.0, 20.0, 30.0]), 0, level)

    assert torch.equal(torch.func.vmap(inner)(torch.ones(3)), torch.tensor([11.0, 21.0, 31.0]))


def test_is_functorch_wrapped_tensor():
    assert not _torch.is_functorch_wrapped_tensor(torch.ones(2))
    seen = []
    torch.func.vmap(lambda t: seen.append(_torch.is_functorch_wrapped_tensor(t)) or t)(
        torch.ones(3, 2)
    )
    torch.func.grad(lambda t: seen.append(_torch.is_functorch_wrapped_tensor(t)) or t.sum())(
        torch.ones(2)
    )
    assert seen == [True, True]


def test_get_unwrapped():
    shapes = []

    def inner(t):
        plain = t
        while _torch.is_functorch_wrapped_tensor(plain):
            plain = _torch.get_unwrapped(plain)
        shapes.append((t.shape, plain.shape, _torch.is_functorch_wrapped_tensor(plain)))
        return t

    torch.func.vmap(inner)(torch.ones(5, 2))
    assert shapes == [((2,), (5, 2), False)]  # the batched tensor under the wrapper


def test_current_autograd_node():
    assert _torch.current_autograd_node() is None
    x = torch.ones(2, requires_grad=True)
    with _Seen() as seen:
        loss = (x * x).sum()
        loss.backward()
    forward = [func for func, backward in seen.ops if not backward]
    backward = [func for func, backward in seen.ops if backward]
    assert torch.ops.aten.sum.default in forward and torch.ops.aten.mul.Tensor in backward
    assert _torch.current_autograd_node() is None


def test_forward_ad_active():
    import torch.autograd.forward_ad as fw

    assert not _torch.forward_ad_active()
    with fw.dual_level():
        assert _torch.forward_ad_active()
    assert not _torch.forward_ad_active()


# -- tensor ops -----------------------------------------------------------------------------------


def test_foreach_norm():
    tensors = [torch.tensor([3.0, 4.0]), torch.full((4,), 2.0)]
    tensors.append(torch.ones(2, 2, dtype=torch.float64))
    norms = _torch.foreach_norm(tensors, 2)
    assert len(norms) == 3
    for norm, t in zip(norms, tensors, strict=True):
        assert norm.dtype == t.dtype and norm.shape == ()
        assert torch.equal(norm, torch.linalg.vector_norm(t, 2))


def test_is_alias_of():
    a = torch.arange(6.0)
    assert _torch.is_alias_of(a[2:], a) and _torch.is_alias_of(a.view(2, 3), a)
    assert not _torch.is_alias_of(a.clone(), a)
    with _torch.FakeTensorMode():
        f = torch.empty(6)
        assert _torch.is_alias_of(f.view(3, 2), f) and not _torch.is_alias_of(f + 1, f)


def test_make_subclass():
    class Marked(torch.Tensor):
        pass

    plain = torch.tensor([1.0, 2.0], requires_grad=True)
    marked = _torch.make_subclass(Marked, plain)
    assert type(marked) is Marked and not marked.requires_grad and marked.grad_fn is None
    assert marked.data_ptr() == plain.data_ptr() and marked is not plain
    marked.instance_attribute = "kept"  # an ordinary Python object: attributes can be set
    assert marked.instance_attribute == "kept"


# -- simulated low-precision matmuls (minitrain.precision) ----------------------------------------


def test_is_batchedtensor():
    seen = []
    torch.func.vmap(lambda t: seen.append(_torch.is_batchedtensor(t)) or t)(torch.ones(3, 2))
    torch.func.grad(lambda t: seen.append(_torch.is_batchedtensor(t)) or t.sum())(torch.ones(2))
    assert seen == [True, False]


def test_maybe_get_level():
    levels = []

    def inner(t):  # a vmap inside a grad: levels grow inward
        levels.append(_torch.maybe_get_level(t))
        plain = _torch.get_unwrapped(t)
        levels.append(_torch.maybe_get_level(plain))
        return t.sum()

    torch.func.grad(lambda t: torch.func.vmap(inner)(t).sum())(torch.ones(3, 2))
    assert levels[0] > levels[1] >= 1


def test_scaled_mm():
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    b = torch.ones(32, 16).to(torch.float8_e4m3fn).T.contiguous().T  # column-major
    one = torch.tensor(1.0)
    out = _torch.scaled_mm(a, b, scale_a=one, scale_b=torch.tensor(0.5), out_dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, torch.full((16, 16), 16.0))


def test_disable_dynamo():
    calls = []

    @_torch.disable_dynamo
    def eager(x):
        calls.append(torch.compiler.is_compiling())
        return x + 1

    assert torch.equal(eager(torch.ones(1)), torch.full((1,), 2.0)) and calls == [False]



# -- optimizer kernels and their guards (minitrain.optim) -----------------------------------------


def test_foreach():
    used = ["add", "add_", "sub", "mul", "div", "neg", "sqrt", "abs", "sign", "exp", "pow",
            "lerp", "maximum", "addcmul", "clamp_min", "clamp_max", "copy_", "norm"]
    assert not [name for name in used if name not in _torch.foreach]
    a, b = [torch.tensor([1.0, -4.0]), torch.full((3,), 9.0)], [torch.ones(2), torch.ones(3)]
    assert [t.tolist() for t in _torch.foreach["mul"](a, 2.0)] == [[2.0, -8.0], [18.0] * 3]
    assert [t.tolist() for t in _torch.foreach["add"](a, b)] == [[2.0, -3.0], [10.0] * 3]
    assert [t.tolist() for t in _torch.foreach["lerp"](a, b, 0.5)] == [[1.0, -1.5], [5.0] * 3]
    clamped = _torch.foreach["clamp_max"](_torch.foreach["clamp_min"](a, -1.0), 2.0)
    assert [t.tolist() for t in clamped] == [[1.0, -1.0], [2.0] * 3]
    out = [torch.empty(2), torch.empty(3)]
    _torch.foreach["copy_"](out, a)
    assert all(torch.equal(x, y) for x, y in zip(out, a, strict=True))
    _torch.foreach["add_"](out, b)  # in place
    assert out[1].tolist() == [10.0] * 3 and a[1].tolist() == [9.0] * 3


def _fused_matches(kernel, make, run):
    """One step of ``kernel`` (torch's fused op, via ``run``) equals torch.optim's ``make``."""
    torch.manual_seed(0)
    p, g = torch.randn(5), torch.randn(5)
    reference = torch.nn.Parameter(p.clone())
    reference.grad = g.clone()
    optimizer = make([reference])
    optimizer.step()
    mine = p.clone()
    run(kernel, mine, g.clone(), optimizer.state[reference])
    assert torch.allclose(mine, reference.detach(), atol=1e-6), (mine, reference)


def _adam_like(kernel, p, g, state, weight_decay):
    steps = [torch.tensor(1.0)]
    kernel([p], [g], [torch.zeros(5)], [torch.zeros(5)], [], steps, lr=0.1, beta1=0.9,
           beta2=0.999, weight_decay=weight_decay, eps=1e-8, amsgrad=False, maximize=False)


def test_fused_adam_():
    _fused_matches(_torch.fused_adam_, lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1,
                                                                      foreach=False),
                   lambda k, p, g, state: _adam_like(k, p, g, state, 0.1))


def test_fused_adamw_():
    _fused_matches(_torch.fused_adamw_, lambda ps: torch.optim.AdamW(
        ps, lr=0.1, weight_decay=0.1, foreach=False),
        lambda k, p, g, state: _adam_like(k, p, g, state, 0.1))


def test_fused_sgd_():
    _fused_matches(_torch.fused_sgd_, lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=False),
        lambda k, p, g, state: k([p], [g], [torch.zeros(5)], weight_decay=0.1, momentum=0.9,
                                 lr=0.1, dampening=0.0, nesterov=False, maximize=False,
                                 is_first_step=True))


def test_fused_adagrad_():
    _fused_matches(_torch.fused_adagrad_, lambda ps: torch.optim.Adagrad(
        ps, lr=0.1, weight_decay=0.1, foreach=False),
        lambda k, p, g, state: k([p], [g], [torch.zeros(5)], [torch.tensor(1.0)], lr=0.1,
                                 lr_decay=0.0, weight_decay=0.1, eps=1e-10, maximize=False))


def test_is_gradtrackingtensor():
    seen = []
    torch.func.vmap(lambda t: seen.append(_torch.is_gradtrackingtensor(t)) or t)(torch.ones(3))
    torch.func.grad(lambda t: seen.append(_torch.is_gradtrackingtensor(t)) or t.sum())(
        torch.ones(2)
    )
    assert seen == [False, True] and not _torch.is_gradtrackingtensor(torch.ones(1))


def test_get_current_dispatch_mode():
    assert _torch.get_current_dispatch_mode() is None
    with _Seen() as mode:
        inside = _torch.get_current_dispatch_mode()
    assert inside is mode and _torch.get_current_dispatch_mode() is None


class _Watch(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_is_torch_function_mode_enabled():
    assert not _torch.is_torch_function_mode_enabled()
    with _Watch():
        assert _torch.is_torch_function_mode_enabled()
    assert not _torch.is_torch_function_mode_enabled()


def test_get_current_function_mode_stack():
    assert _torch.get_current_function_mode_stack() == []
    with _Watch() as outer, _Watch() as inner:
        assert _torch.get_current_function_mode_stack() == [outer, inner]


def test_DeviceContext():
    with torch.device("meta"):
        stack = _torch.get_current_function_mode_stack()
        assert torch.empty(1).is_meta
    assert [type(mode) for mode in stack] == [_torch.DeviceContext]


def test_storage_use_count():
    count = _torch.storage_use_count
    assert count is not None  # else the buffer pool allocates every output afresh
    t = torch.ones(4)
    alone = count(t.untyped_storage()._cdata)
    view = t[1:]
    assert count(t.untyped_storage()._cdata) == alone + 1
    del view
    assert count(t.untyped_storage()._cdata) == alone
