"""``mt.value_and_grad`` outside any transform runs plain ``torch.autograd.grad``; it must give
what ``torch.func.grad_and_value`` (the reference, and the path under vmap/grad/compile) gives:
values, gradients, aux, zeros for unused leaves, errors, and differentiable gradients when the
function closes over a tensor that requires grad."""

import pytest
import torch
import torch.utils.checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt


def _reference(fn, argnums=0, has_aux=False):
    def run(*args, **kwargs):
        grads, value = torch.func.grad_and_value(fn, argnums=argnums, has_aux=has_aux)(
            *args, **kwargs
        )
        return value, grads

    return run


def _assert_same(got, want):
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    assert got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.requires_grad == w.requires_grad
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _transforms_seen(fn):
    """``fn`` recording whether a torch.func transform is active while it runs."""
    seen = []

    def recorded(*args, **kwargs):
        seen.append(torch._C._functorch.peek_interpreter_stack() is not None)
        return fn(*args, **kwargs)

    return recorded, seen


def _mlp_loss(params, batch, scale):
    x, y = batch
    hidden = torch.tanh(x @ params["layers"][0]["w"] + params["layers"][0]["b"])
    out = hidden @ params["layers"][1]["w"]
    loss = ((out.squeeze(-1) - y) ** 2).mean() * scale
    return loss, {"hidden_max": hidden.max(), "pair": (out.min(), out.mean())}


def _mlp(g, width):
    return {
        "layers": [
            {"w": torch.randn(3, width, generator=g), "b": torch.randn(width, generator=g)},
            {"w": torch.randn(width, 1, generator=g), "unused": torch.randn(2, generator=g)},
        ]
    }


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    width=st.integers(1, 8),
    argnums=st.sampled_from([0, (0,), (0, 1), (1, 0)]),
    double=st.booleans(),
    transposed=st.booleans(),
)
def test_plain_path_equals_torch_func(seed, width, argnums, double, transposed):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if double else torch.float32
    params = mt.tree.map(lambda t: t.to(dtype), _mlp(g, width))
    if transposed:  # a non-contiguous leaf: its grad's values, whatever its strides
        params["layers"][0]["w"] = params["layers"][0]["w"].T.contiguous().T
    batch = (torch.randn(5, 3, generator=g, dtype=dtype), torch.randn(5, generator=g, dtype=dtype))
    fn, seen = _transforms_seen(_mlp_loss)
    got = mt.value_and_grad(fn, argnums=argnums, has_aux=True)(params, batch, 0.5)
    want = _reference(_mlp_loss, argnums=argnums, has_aux=True)(params, batch, 0.5)
    assert seen == [False]  # the plain path ran
    _assert_same(got, want)
    assert not any(t.requires_grad for t in mt.tree.leaves(params))  # the caller's leaves


def test_unused_leaf_gets_zeros_and_constant_loss_gets_all_zeros():
    params = {"used": torch.ones(2), "unused": torch.ones(3)}
    value, grads = mt.value_and_grad(lambda p: (p["used"] * 2).sum())(params)
    assert torch.equal(grads["unused"], torch.zeros(3)) and torch.equal(
        grads["used"], 2 * torch.ones(2)
    )
    got = mt.value_and_grad(lambda p: torch.tensor(1.0))(params)
    _assert_same(got, _reference(lambda p: torch.tensor(1.0))(params))


def test_closed_over_tensor_requiring_grad_keeps_gradients_differentiable():
    lr = torch.tensor(0.3, requires_grad=True)
    loss = lambda w: (lr * w**3).sum()  # noqa: E731
    w = torch.tensor([1.0, 2.0])
    (v1, g1), (v2, g2) = mt.value_and_grad(loss)(w), _reference(loss)(w)
    _assert_same((v1, g1), (v2, g2))
    # d/dlr of sum(grad) = sum(3 w^2) = 15
    (d1,), (d2,) = torch.autograd.grad(g1.sum(), lr), torch.autograd.grad(g2.sum(), lr)
    assert d1.item() == d2.item() == pytest.approx(15.0)


@pytest.mark.parametrize("recording", [True, False])
@pytest.mark.parametrize("source", ["argument", "keyword", "non-leaf argument", "closure"])
def test_a_tensor_not_differentiated_that_requires_grad_keeps_gradients_differentiable(
    source, recording
):
    """Every way a tensor that requires grad reaches the function besides the differentiated
    argument: value and grads equal torch.func's, and differentiate alike through it; called
    under no_grad, neither is differentiable, as torch.func's are not."""
    scale = torch.tensor([0.5, 2.0], requires_grad=True)

    def loss(w, x=None, *, k=None):
        s = {"argument": x, "non-leaf argument": x, "keyword": k, "closure": scale}[source]
        return (s * w**3).sum()

    x = {"argument": scale, "non-leaf argument": scale * 1.0}.get(source)
    kwargs = {"k": scale} if source == "keyword" else {}
    w = torch.tensor([1.0, 2.0])
    with torch.set_grad_enabled(recording):
        got, want = mt.value_and_grad(loss)(w, x, **kwargs), _reference(loss)(w, x, **kwargs)
    _assert_same(got, want)
    assert scale.grad is None and w.grad is None  # no backward() reached a tensor outside
    if not recording:
        assert not got[1].requires_grad and not got[0].requires_grad
        return
    assert got[1].requires_grad  # d/dscale of sum(3 scale w^2) = 3 w^2
    (d1,), (d2,) = (
        torch.autograd.grad(g.sum(), scale, retain_graph=True) for g in (got[1], want[1])
    )
    assert torch.equal(d1, d2) and torch.equal(d1, 3 * w**2)


def test_argument_requiring_grad_takes_torch_func_and_stays_differentiable():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    fn, seen = _transforms_seen(lambda w: (w**3).sum())
    _, grads = mt.value_and_grad(fn)(w)
    assert seen == [True]
    (second,) = torch.autograd.grad(grads.sum(), w)  # d/dw sum(3 w^2) = 6 w
    assert torch.equal(second, torch.tensor([6.0, 12.0]))


@pytest.mark.parametrize("wrap", ["vmap", "grad", "compile"])
def test_inside_transforms_uses_torch_func(wrap):
    loss, seen = _transforms_seen(lambda w, x: (w * x).sin().sum())
    inner = mt.value_and_grad(loss)
    w, xs = torch.tensor([0.5, 1.5]), torch.randn(4, 2, generator=torch.Generator().manual_seed(0))
    if wrap == "vmap":
        values, grads = mt.vmap(inner, in_dims=(None, 0))(w, xs)
        assert torch.allclose(grads, xs * torch.cos(w * xs))
    elif wrap == "grad":  # a Hessian-vector product: the inner gradient is differentiated
        hvp = mt.grad(lambda w: inner(w, xs[0])[1].sum())(w)
        assert torch.allclose(hvp, -(xs[0] ** 2) * torch.sin(w * xs[0]))
    else:
        torch._dynamo.reset()
        values, grads = torch.compile(inner, backend="eager", fullgraph=True)(w, xs[0])
        assert torch.allclose(grads, xs[0] * torch.cos(w * xs[0]))
    assert seen and all(seen)


def test_checkpointed_loss_on_the_plain_path():
    def block(w, x):
        return torch.tanh(x @ w)

    def loss(w, x, checkpoint):
        h = (
            torch.utils.checkpoint.checkpoint(block, w, x, use_reentrant=False)
            if checkpoint
            else block(w, x)
        )
        return (h**2).sum()

    w, x = torch.randn(3, 3, generator=torch.Generator().manual_seed(1)), torch.randn(2, 3)
    _assert_same(mt.value_and_grad(loss)(w, x, True), _reference(loss)(w, x, False))


def test_no_grad_outside_is_ignored_like_torch_func():
    with torch.no_grad():
        got = mt.value_and_grad(lambda w: (w**2).sum())(torch.tensor([3.0]))
    assert torch.equal(got[1], torch.tensor([6.0]))


@pytest.mark.parametrize(
    "fn, args, has_aux, argnums",
    [
        (lambda w: w * 2, (torch.ones(2),), False, 0),  # not a scalar
        (lambda w: 1.0, (torch.ones(2),), False, 0),  # not a tensor
        (lambda w: w.sum(), (torch.ones(2),), True, 0),  # has_aux without a pair
        (lambda w: (w.sum(), {"n": 3}), (torch.ones(2),), True, 0),  # aux not a tensor
        (lambda w: w.sum(), (torch.ones(2, dtype=torch.int64),), False, 0),  # integer leaf
        (lambda w: w.sum(), (torch.ones(2),), False, 1),  # argnums past the arguments
        (lambda w: w.sum(), ("text",), False, 0),  # not a tensor to differentiate
    ],
)
def test_errors_are_torch_funcs(fn, args, has_aux, argnums):
    with pytest.raises(Exception) as want:
        _reference(fn, argnums=argnums, has_aux=has_aux)(*args)
    with pytest.raises(type(want.value)) as got:
        mt.value_and_grad(fn, argnums=argnums, has_aux=has_aux)(*args)
    assert str(got.value) == str(want.value)


def test_saved_tensor_hooks_inside_see_the_plain_path():
    seen = []
    with mt.func.saved_tensor_hooks_inside(lambda t: seen.append(t.shape) or t, lambda t: t):
        mt.value_and_grad(lambda w: w.exp().sum())(torch.ones(3))
    assert seen == [torch.Size([3])]
