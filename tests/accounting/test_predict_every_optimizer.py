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
    assert pred.memory["persistent"]["optimizer_state"] == mt.tree.nbytes(opt.init(params))
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
    assert pred.memory["persistent"]["optimizer_state"] == mt.tree.nbytes(opt.init(params))
