"""Gradient transformations and their chains (``chain``, ``as_optimizer``, ``apply_updates``,
the global-norm clip) against torch.optim and ``clip_grad_norm_``; a chain built by hand is the
alias of the same arguments; donation, tied and aliased leaves, function modes and refusals.

Wrappers (MultiSteps, ema, apply_if_finite, masked, multi_transform, inject_hyperparams) are in
``test_wrappers.py``."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import minitrain as mt
from minitrain.optim import (
    add_decayed_weights,
    apply_updates,
    as_optimizer,
    chain,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_rms,
    trace,
)
from tests.optim.conftest import small_data, torch_run, tx_run


def _opt_run(opt, params, grads, requires_grad=False):
    params = [p.clone().requires_grad_(requires_grad) for p in params]
    state = opt.init(params)
    for step_grads in grads:
        params, state = opt.update(step_grads, state, params)
    return [p.detach() for p in params]


CHAINS = {
    "adamw": (
        lambda: chain(scale_by_adam(0.8, 0.99, 1e-6, amsgrad=True), add_decayed_weights(0.1),
                      scale_by_learning_rate(0.01)),
        torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1,
                                amsgrad=True),
    ),
    "adam_l2": (
        lambda: chain(add_decayed_weights(0.1), scale_by_adam(), scale_by_learning_rate(0.01)),
        torch.optim.Adam, dict(lr=0.01, weight_decay=0.1),
    ),
    "sgd_nesterov": (
        lambda: chain(add_decayed_weights(0.01), trace(0.9, nesterov=True),
                      scale_by_learning_rate(0.1)),
        torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "sgd_dampening": (
        lambda: chain(trace(0.5, dampening=0.3), scale_by_learning_rate(0.1)),
        torch.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.3),
    ),
    "rmsprop_centered_momentum": (
        lambda: chain(scale_by_rms(0.9, 1e-6, centered=True), trace(0.9),
                      scale_by_learning_rate(0.01)),
        torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, eps=1e-6, centered=True, momentum=0.9),
    ),
    "adagrad": (
        lambda: chain(add_decayed_weights(0.01), mt.optim.scale_by_adagrad(0.01),
                      scale_by_learning_rate(0.1)),
        torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.01),
    ),
}


@pytest.mark.parametrize("requires_grad", [False, True], ids=["batched", "plain"])
@pytest.mark.parametrize("name", CHAINS)
def test_chains_of_transforms_match_torch_optim_and_the_alias(name, requires_grad):
    """The chain op by op and through ``as_optimizer`` (which may run a fused kernel) against
    the torch.optim class; through ``as_optimizer`` it is the alias of the same arguments, to
    the bit."""
    make, cls, kwargs = CHAINS[name]
    params, grads = small_data(0, 6)
    alias = as_optimizer(make()) if requires_grad else getattr(mt.optim, cls.__name__.lower())(
        **kwargs)
    with torch.set_grad_enabled(requires_grad):
        ours, _ = tx_run(make(), params, grads, requires_grad, lowered=False)
        lowered, _ = tx_run(make(), params, grads, requires_grad)
        by_alias = _opt_run(alias, params, grads, requires_grad)
    for a, b, c in zip(ours, lowered, by_alias, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(b, c)
    for a, b in zip(ours, torch_run(cls, kwargs, params, grads), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", CHAINS)
def test_batched_and_plain_paths_agree_to_the_bit(name):
    make = CHAINS[name][0]
    params, grads = small_data(1, 4)
    batched, state_b = tx_run(make(), params, grads, lowered=False)
    with torch.enable_grad():
        plain, state_p = tx_run(make(), params, grads, requires_grad=True, lowered=False)
    for a, b in zip(batched, plain, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(mt.tree.leaves(state_b), mt.tree.leaves(state_p), strict=True):
        assert torch.equal(a, b.detach())


# --------------------------------------------------------------------------------------------
# The global-norm clip


def test_clip_by_global_norm_has_both_forms_and_matches_torch():
    grads = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    clipped, norm = mt.optim.clip_by_global_norm(grads, 1.0)
    tx = mt.optim.clip_by_global_norm(1.0)
    updates, _ = tx.update(grads, tx.init(grads))
    ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(ps, grads.values(), strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(ps, 1.0)
    for ours, both, p in zip(updates.values(), clipped.values(), ps, strict=True):
        torch.testing.assert_close(ours, p.grad)
        assert torch.equal(ours, both)
    assert float(norm) == 5.0


@pytest.mark.parametrize("dtypes", [(torch.float64, torch.float64), (torch.float64, torch.float32)])
@pytest.mark.parametrize("path", ["fast", "autograd"])
def test_clip_by_global_norm_in_fp64_equals_clip_grad_norm(dtypes, path):
    """fp64 grads: the norm is taken in fp64 (torch's clip_grad_norm_ takes each norm in its
    grads' dtype), so norm and clipped grads equal torch's to the bit."""
    g = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(37, 11, generator=g, dtype=dtypes[0]) * 3.0,
             "b": torch.randn(11, generator=g, dtype=dtypes[1])}
    ps = [torch.nn.Parameter(torch.zeros_like(v)) for v in grads.values()]
    for p, v in zip(ps, grads.values(), strict=True):
        p.grad = v.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
    assert want_norm.dtype == torch.float64
    if path == "autograd":
        grads = {k: v.clone().requires_grad_(True) for k, v in grads.items()}
    clipped, norm = mt.optim.clip_by_global_norm(grads, 1.0)
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm, want_norm, rtol=0, atol=0)
    for (name, value), p in zip(clipped.items(), ps, strict=True):
        assert value.dtype == p.dtype, name
        torch.testing.assert_close(value.detach(), p.grad, rtol=0, atol=0)
    tx = mt.optim.clip_by_global_norm(1.0)
    updates, _ = tx.update(grads, tx.init(grads))
    for value, p in zip(updates.values(), ps, strict=True):
        torch.testing.assert_close(value.detach(), p.grad, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(max_norm=st.one_of(st.sampled_from([1e-3, 0.5, 1, 3.0, 1e6, math.inf]),
                          st.floats(1e-30, 1e30)),
       scale=st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e3, 1e18]), seed=st.integers(0, 2**16))
def test_clip_by_global_norm_equals_clip_grad_norm_to_the_bit(max_norm, scale, seed):
    """Its factor is torch's float32 ops on the norm (min(1, max_norm / (norm + 1e-6))), in
    both forms, across the float range."""
    g = torch.Generator().manual_seed(seed)
    grads = {"w": torch.randn(40, 33, generator=g) * scale, "b": torch.randn(33, generator=g)}
    ps = [torch.nn.Parameter(torch.zeros_like(v)) for v in grads.values()]
    for p, v in zip(ps, grads.values(), strict=True):
        p.grad = v.clone()
    want = torch.nn.utils.clip_grad_norm_(ps, max_norm)
    clipped, norm = mt.optim.clip_by_global_norm(grads, max_norm)
    tx = mt.optim.clip_by_global_norm(max_norm)
    updates, _ = tx.update(grads, tx.init(grads))
    exact = dict(rtol=0, atol=0, equal_nan=True)  # inf / inf is NaN in both
    torch.testing.assert_close(norm, want, **exact)
    for value, by_tx, p in zip(clipped.values(), updates.values(), ps, strict=True):
        torch.testing.assert_close(value, p.grad, **exact)
        torch.testing.assert_close(by_tx, p.grad, **exact)


def test_clipping_an_expanded_grad_gives_the_clones_result():
    # What autograd gives for p.sum(): an expanded grad (torch.func.grad does not copy it).
    tx = mt.optim.clip_by_global_norm(0.5)
    g = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(8, generator=g).expand(32, 8), "b": torch.randn(32, 8, generator=g)}
    clipped, _ = tx.update(grads, tx.init(grads))
    expected, _ = tx.update({k: v.clone() for k, v in grads.items()}, tx.init(grads))
    torch.testing.assert_close(clipped, expected)


@pytest.mark.parametrize("decoupled", [False, True])
def test_a_leading_clip_gives_the_aliases_update_of_the_clipped_grads(decoupled):
    params, grads = small_data(3, 4)

    def make():
        return chain(
            mt.optim.clip_by_global_norm(0.5), scale_by_adam(), add_decayed_weights(0.1),
            scale_by_learning_rate(0.01),
        ) if decoupled else chain(
            mt.optim.clip_by_global_norm(0.5), add_decayed_weights(0.1), scale_by_adam(),
            scale_by_learning_rate(0.01),
        )

    lowered, _ = tx_run(make(), params, grads)
    op_by_op, _ = tx_run(make(), params, grads, lowered=False)
    factory = mt.optim.adamw if decoupled else mt.optim.adam
    clipped_first = [mt.optim.clip_by_global_norm(g, 0.5)[0] for g in grads]
    by_alias = _opt_run(factory(lr=0.01, weight_decay=0.1), params, clipped_first)
    for a, b, c in zip(lowered, by_alias, op_by_op, strict=True):
        # the kernel sums squares in float64, torch's foreach_norm in float32 lanes whose width
        # is the CPU's (AVX2, AVX-512): the norms, so the clip factors, can differ by an ulp
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def _chain(lr=0.1):
    return mt.optim.chain(mt.optim.clip_by_global_norm(0.1), mt.optim.scale_by_adam(eps=1.0),
                          mt.optim.scale_by_learning_rate(lr))


def _by_the_chain(params, grads):
    tx = _chain()
    updates, _ = tx.update(grads, tx.init(params), params)
    return mt.optim.apply_updates(params, updates)


def test_non_dense_params_keep_the_clip():
    params = {"w": torch.ones(4, 8)[:, ::2]}
    grads = {"w": torch.full((4, 4), 10.0)}
    opt = mt.optim.as_optimizer(_chain())
    new, _ = opt.update(grads, opt.init(params), params)
    torch.testing.assert_close(new["w"], _by_the_chain(params, grads)["w"])


def test_an_update_inside_a_schedule_keeps_the_outer_updates_clip():
    box = {}

    def schedule(count):
        if "opt" in box and not box.get("done"):
            box["done"] = True
            inner = {"w": torch.ones(4)}
            box["opt"].update({"w": torch.ones(4)}, box["opt"].init(inner), inner)
        return 0.1

    opt = box["opt"] = mt.optim.as_optimizer(_chain(schedule))
    params, grads = {"w": torch.ones(8)}, {"w": torch.full((8,), 10.0)}
    new, _ = opt.update(grads, opt.init(params), params)
    assert box["done"]
    torch.testing.assert_close(new["w"], _by_the_chain(params, grads)["w"])


class _Watching(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_torch_function_mode_sees_the_update_and_changes_no_number():
    """A function mode is the caller's code: it sees the update's torch ops (no kernel runs
    past it), and the numbers are those of the update without it."""
    params, grads = {"w": torch.randn(300)}, {"w": torch.randn(300)}
    opt = as_optimizer(_chain())
    want, _ = opt.update(grads, opt.init(params), params)
    with _Watching() as mode:
        got, _ = opt.update(grads, opt.init(params), params)
    assert mode.calls > 0
    torch.testing.assert_close(got["w"], want["w"])


# --------------------------------------------------------------------------------------------
# as_optimizer: donation, tied and aliased leaves, refusals


@pytest.mark.parametrize("donate", [False, True])
def test_as_optimizer_of_an_unlowered_chain_donates_or_not_alike(donate):
    tx = mt.optim.chain(mt.optim.scale_by_sign(), mt.optim.trace(0.9),
                        mt.optim.scale_by_learning_rate(0.1))
    opt = mt.optim.as_optimizer(tx)
    params = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0))]
    reference = opt.update([torch.ones(5, 3)], opt.init(params), params)[0]
    given = [params[0].clone()]
    out = opt.update([torch.ones(5, 3)], opt.init(given), given, donate=donate)[0]
    assert torch.equal(out[0], reference[0])
    assert (out[0].data_ptr() == given[0].data_ptr()) == donate


@pytest.mark.parametrize("factory", [
    lambda: as_optimizer(chain(mt.optim.clip_by_global_norm(1.0), scale_by_adam(),
                               add_decayed_weights(0.1), scale_by_learning_rate(0.01))),
    lambda: as_optimizer(chain()),  # no lowering: the updates (the grads) are added in place
], ids=["chain", "identity-chain"])
def test_donating_grads_that_are_other_leaves_params_gives_the_pure_result(factory):
    def run(donate):
        torch.manual_seed(0)
        x, y = torch.randn(1000), torch.randn(1000)
        params = {"a": x, "b": y}
        opt = factory()
        new, _ = opt.update({"a": y, "b": x}, opt.init(params), params, donate=donate)
        return new

    pure, donated = run(False), run(True)
    for key in pure:
        torch.testing.assert_close(donated[key], pure[key], rtol=0, atol=0)


TIED = {
    "chain": lambda: as_optimizer(chain(
        mt.optim.clip_by_global_norm(1.0), scale_by_adam(), scale_by_learning_rate(0.1))),
    "unlowered chain": lambda: as_optimizer(chain(
        mt.optim.scale_by_sign(), scale_by_learning_rate(0.1))),
}


@pytest.mark.parametrize("name", TIED)
def test_a_tensor_passed_twice_and_donated_is_updated_as_without_donation(name):
    # Tied weights as two leaves: updating each leaf in place would update the tensor twice.
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(64, 32, generator=g)}
    expected = []
    for donate in (False, True):
        w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
        params = {"a": w, "b": w}
        opt = TIED[name]()
        state = opt.init(params)
        for _ in range(2):
            params, state = opt.update(grads, state, params, donate=donate)
        expected.append(params)
    torch.testing.assert_close(expected[1], expected[0], rtol=0, atol=0)


def test_a_lowered_chain_keeps_donating_though_its_state_shares_one_count():
    opt = TIED["chain"]()
    params = [torch.randn(64, 32, generator=torch.Generator().manual_seed(0))]
    state = opt.init(params)
    for _ in range(3):
        given = params[0].data_ptr()
        params, state = opt.update([torch.ones(64, 32)], state, params, donate=True)
        assert params[0].data_ptr() == given


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's, on making one
def test_a_sparse_grad_to_a_chain_is_a_value_error_naming_its_leaf(layout):
    opt = as_optimizer(chain(mt.optim.clip_by_global_norm(1.0), scale_by_adam(),
                             scale_by_learning_rate(0.1)))
    params = {"emb": torch.ones(4, 3)}
    dense = torch.zeros(4, 3)
    dense[1] = 1.0  # an embedding's grad: the rows looked up
    grad = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(ValueError, match="grad of 'emb' is a torch.sparse_.* dense grads"):
        opt.update({"emb": grad}, opt.init(params), params)


PLACES = {
    "as_optimizer": "optim.as_optimizer(opt)",
    "MultiSteps": "optim.MultiSteps(opt, every_k=2)",
    "apply_if_finite": "optim.apply_if_finite(opt)",
    "masked": "optim.masked(opt, lambda name, leaf: True)",
    "multi_transform": "optim.multi_transform({'all': opt}, lambda name, leaf: 'all')",
    "chain": "optim.chain(optim.clip(1.0), opt)",
    "inject_hyperparams": "optim.as_optimizer(optim.inject_hyperparams(optim.sgd)(lr=0.1))"
                          ".init({'w': torch.ones(2)})",
}
ALIASES = ["sgd", "adam", "nadam", "muon"]


def test_an_optimizer_where_a_transformation_goes_is_a_one_line_value_error():
    code = (
        "import torch, minitrain as mt\n"
        "optim = mt.optim\n"
        f"for alias in {ALIASES!r}:\n"
        f"    for place, call in {PLACES!r}.items():\n"
        "        opt = getattr(optim, alias)()\n"
        "        try:\n"
        "            eval(call)\n"
        "        except ValueError as err:\n"
        "            assert 'is an Optimizer; pass a GradientTransformation' in str(err), err\n"
        "            assert '\\n' not in str(err)\n"
        "        else:\n"
        "            raise AssertionError(f'{place} took {alias}')\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "MINITRAIN_TYPECHECK": "0"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_inject_hyperparams_over_a_transformation_still_steps():
    """The regression guard: a transformation factory gives torch's SGD step."""
    injected = mt.optim.inject_hyperparams(mt.optim.scale_by_learning_rate)(learning_rate=0.1)
    opt = mt.optim.as_optimizer(injected)
    params = {"w": torch.tensor([1.0, 2.0])}
    params, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    assert params["w"].tolist() == pytest.approx([0.9, 1.9])


# --------------------------------------------------------------------------------------------
# Hyperparameters and apply_updates


def test_hyperparameters_are_checked_like_torch_optim():
    with pytest.raises(ValueError, match="lr"):  # (scale_by_learning_rate: one per member)
        mt.optim.sgd(torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="betas"):  # torch.optim.Adam refuses the mix
        mt.optim.adam(betas=(0.9, torch.tensor(0.99)))
    # The transform takes it (inject_hyperparams makes one beta a tensor), as optax does.
    mixed, plain = scale_by_adam(0.9, torch.tensor(0.99)), scale_by_adam(0.9, 0.99)
    grads = [torch.tensor([1.0, -2.0])]
    torch.testing.assert_close(mixed.update(grads, mixed.init(grads))[0][0],  # a float32 beta
                               plain.update(grads, plain.init(grads))[0][0])
    with pytest.raises(ValueError, match="betas"):
        scale_by_adam(1.5)
    tx = scale_by_adam(torch.tensor([[[0.9]]]), torch.tensor([[0.999]]))
    updates, state = tx.update([torch.ones(4, 3)], tx.init([torch.zeros(4, 3)]))
    assert updates[0].shape == (4, 3)
    with pytest.raises(ValueError, match="nesterov"):
        trace(0.0, nesterov=True)
    with pytest.raises(ValueError, match="chain argument 0"):
        chain(mt.optim.sgd())


def test_leafwise_state_shape_mismatch_names_the_leaf():
    tx = scale_by_adam()
    state = tx.init({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"state.exp_avg leaf .*'w'.*shape \(3,\)"):
        tx.update({"w": torch.zeros(4)}, state)


def test_apply_updates_is_pure_and_keeps_dtypes():
    params = {"w": torch.ones(2, dtype=torch.bfloat16)}
    out = apply_updates(params, {"w": torch.full((2,), 0.25)})
    assert out["w"].dtype == torch.bfloat16 and torch.equal(params["w"], torch.ones(2).bfloat16())


@pytest.mark.parametrize(("params", "updates", "message"), [
    ({"a": torch.ones(())}, {"a": 2.0},
     "apply_updates: updates leaf 'a' is of type float, not a tensor; pass torch.tensor(2.0)"),
    ({"a": 1.0}, {"a": torch.ones(())},
     "apply_updates: param 'a' is of type float, not a tensor; pass torch.tensor(1.0)"),
    ({"a": torch.ones(2)}, {"a": None}, "the grad of 'a' is None"),
    ({"a": None}, {"a": torch.ones(2)}, "'a' is None"),
])
def test_a_leaf_that_is_no_tensor_is_named_in_one_line(params, updates, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        apply_updates(params, updates)
    assert "\n" not in str(error.value)
    assert "shape" not in str(error.value)


def test_tensor_leaves_still_add_in_the_params_dtype():
    params = {"w": torch.ones(2, dtype=torch.bfloat16), "i": torch.tensor([3])}
    out = apply_updates(params, {"w": torch.full((2,), 0.5), "i": torch.tensor([1.7])})
    assert out["w"].dtype == torch.bfloat16 and out["w"].tolist() == [1.5, 1.5]
    # (3 + 1.7) cast to int64 as torch casts
    assert out["i"].dtype == torch.int64 and out["i"].tolist() == [4]
