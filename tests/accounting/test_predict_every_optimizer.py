"""predict_step (and so the end-of-run report and ``minitrain estimate step``) works for every
optimizer in the registry (tests/optim/conftest.py), with and without clipping, and for the
chain the README shows: the optimizer state it predicts is the state ``init`` builds."""

import pytest
import torch

import minitrain as mt
from minitrain.accounting.predict import predict_step
from tests.optim.conftest import OPTAX_ONLY, OPTIMIZERS

ENTRIES = OPTIMIZERS + OPTAX_ONLY
MATMULS_IN_UPDATE = {"adafactor", "muon"}  # the factored moment's outer product, Newton-Schulz


def stored_bytes(tree) -> int:
    """Bytes of the distinct storages of ``tree``'s tensors (a state may share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in mt.tree.leaves(tree) if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def loss(params, batch):
    x, y = batch
    out = x @ params["w"]
    if "b" in params:
        out = out + params["b"]
    return (out.sum(-1) - y).square().mean()


def problem(entry):
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(16, 8, generator=g)}
    if not entry.matrices_only:
        params["b"] = torch.zeros(8)
    return params, (torch.randn(32, 16, generator=g), torch.randn(32, generator=g))


@pytest.mark.parametrize("entry", ENTRIES, ids=str)
@pytest.mark.parametrize("clip", [None, 1.0], ids=["plain", "clipped"])
def test_every_optimizer_is_predicted(entry, clip):
    params, batch = problem(entry)
    opt = entry.make()
    pred = predict_step(loss, params, batch, optimizer=opt, max_grad_norm=clip)
    assert pred.memory["persistent"]["optimizer_state"] == stored_bytes(opt.init(params))
    assert pred.memory["persistent"]["params"] == mt.tree.nbytes(params)
    step = 2 * (2 * 32 * 16 * 8)  # x @ w, then x.T @ grad for w's grad
    if entry.alias in MATMULS_IN_UPDATE:
        assert pred.matmul_flops > step
    else:
        assert pred.matmul_flops == step
    assert pred.peak_bytes > 0


def test_the_readme_chain_is_predicted():
    params, batch = problem(OPTIMIZERS[0])
    schedule = mt.optim.cosine_schedule(1e-3, 100)
    tx = mt.optim.chain(mt.optim.clip_by_global_norm(1.0), mt.optim.scale_by_adam(),
                        mt.optim.add_decayed_weights(0.1),
                        mt.optim.scale_by_learning_rate(schedule))
    opt = mt.optim.as_optimizer(tx)
    pred = predict_step(loss, params, batch, optimizer=opt)
    assert pred.memory["persistent"]["optimizer_state"] == stored_bytes(opt.init(params))


o = mt.optim
TRANSFORMS = {  # every transformation mt.optim exports, built with example arguments
    "identity": lambda: o.identity(),
    "chain": lambda: o.chain(o.scale_by_adam(), o.scale(-0.1)),
    "reduce_on_plateau": lambda: o.reduce_on_plateau(),
    "scale": lambda: o.scale(-0.1),
    "scale_by_learning_rate": lambda: o.scale_by_learning_rate(0.1),
    "scale_by_adam": lambda: o.scale_by_adam(),
    "scale_by_rms": lambda: o.scale_by_rms(),
    "scale_by_adagrad": lambda: o.scale_by_adagrad(),
    "scale_by_sign": lambda: o.scale_by_sign(),
    "trace": lambda: o.trace(0.9),
    "add_decayed_weights": lambda: o.add_decayed_weights(0.1),
    "clip": lambda: o.clip(1.0),
    "clip_by_global_norm": lambda: o.clip_by_global_norm(1.0),
    "masked": lambda: o.masked(o.scale_by_adam(), {"w": True}),
    "multi_transform": lambda: o.multi_transform({"a": o.scale_by_adam()}, {"w": "a"}),
    "MultiSteps": lambda: o.MultiSteps(o.scale_by_adam(), every_k=2),
    "apply_if_finite": lambda: o.apply_if_finite(o.scale_by_adam()),
    "ema": lambda: o.ema(),
    "inject_hyperparams": lambda: o.inject_hyperparams(o.scale_by_adam)(b1=0.9),
    "scale_by_adadelta": lambda: o.scale_by_adadelta(),
    "scale_by_adamax": lambda: o.scale_by_adamax(),
    "scale_by_lion": lambda: o.scale_by_lion(),
    "scale_by_nadam": lambda: o.scale_by_nadam(),
    "scale_by_radam": lambda: o.scale_by_radam(),
    "scale_by_schedule_free_adamw": lambda: o.scale_by_schedule_free_adamw(),
    "scale_by_belief": lambda: o.scale_by_belief(),
    "scale_by_yogi": lambda: o.scale_by_yogi(),
    "scale_by_trust_ratio": lambda: o.scale_by_trust_ratio(),
    "ema_updates": lambda: o.ema_updates(0.9),
    "scale_by_adafactor": lambda: o.scale_by_adafactor(),
    "scale_by_muon": lambda: o.scale_by_muon(),
    "muon_momentum": lambda: o.muon_momentum(),
    "orthogonalize_by_newton_schulz": lambda: o.orthogonalize_by_newton_schulz(),
}
NOT_ALONE = {  # transformations a step cannot run alone, and why
    "leafwise": "a builder of transformations from per-leaf functions",
    "scale_by_polyak": "needs the loss value (value=), as polyak_sgd passes it",
    "differentially_private_aggregate": "takes per-example grads (a leading batch dim)",
    "lookahead": "its params are LookaheadParams(fast, slow), not a model's params",
}


def test_the_table_holds_every_exported_transformation():
    import inspect

    exported = {name for name in o.__all__ if inspect.isfunction(getattr(o, name, None))
                and "GradientTransformation" in str(inspect.signature(
                    getattr(o, name)).return_annotation)}
    exported.add("clip_by_global_norm")  # a function of grads, or a transformation of a number
    assert exported == set(TRANSFORMS) | set(NOT_ALONE)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_every_transformation_is_predicted_in_a_chain(name):
    params, batch = problem(OPTIMIZERS[0])
    params = {"w": params["w"]}  # a matrix: Muon's transformations take matrices only
    opt = o.as_optimizer(o.chain(TRANSFORMS[name](), o.scale_by_learning_rate(0.01)))
    pred = predict_step(loss, params, batch, optimizer=opt)
    assert pred.memory["persistent"]["optimizer_state"] == stored_bytes(opt.init(params))
