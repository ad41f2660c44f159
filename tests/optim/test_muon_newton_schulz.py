"""Muon's Newton-Schulz iteration: torch's ``_zeropower_via_newtonschulz`` bit for bit, counted
and predicted alike."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import minitrain as mt
from minitrain.optim import _muon as ns
from tests.muon_harness import muon_run_against_torch

SHAPES = [(48, 32), (32, 56), (48, 32), (40, 40), (32, 56), (48, 32)]


@pytest.mark.parametrize("shape", [(40, 48), (48, 40), (17, 300), (5, 12), (1, 8), (64, 64)])
@pytest.mark.parametrize("steps", [5, 2, 0])
def test_newton_schulz_is_torchs_bit_for_bit(shape, steps):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape) + steps))
    want = _zeropower_via_newtonschulz(x, ns.NS_COEFFICIENTS, steps, ns.EPS)
    assert torch.equal(mt.optim.newton_schulz(x, steps=steps), want)


def test_a_1024_matrix_equals_torch_optim_muon():
    """One Newton-Schulz iteration (each runs the same GEMMs): without native bfloat16 GEMMs,
    five take over a minute at this size."""
    muon_run_against_torch(steps=1, shapes=[(1024, 1024)], ns_steps=1)


def test_same_shape_matrices_keep_torchs_bits():
    """Tall, wide and square matrices, several of one shape (tall, wide, one side of 17,
    tiny): each matrix's direction torch's own."""
    muon_run_against_torch(steps=2, shapes=SHAPES + [(300, 17)] * 3 + [(5, 12)] * 2)


def test_a_stack_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^newton_schulz takes one matrix, got shape \(2, 3, 3\)"):
        mt.optim.newton_schulz(torch.ones(2, 3, 3))


def test_muon_is_predicted_and_counted_alike():
    """The step predictor (meta and fake tensors) and the accounting Counter see the same
    Newton-Schulz ops: the prediction equals the count."""
    from minitrain.accounting import Counter
    from minitrain.accounting.predict import TensorSpec, predict_step

    params = {f"w{i}": torch.randn(48, 40) for i in range(4)}
    loss = lambda p, x: sum((x @ w).tanh().sum() for w in p.values())  # noqa: E731
    opt = mt.optim.muon(lr=0.02)
    predicted = predict_step(loss, params, TensorSpec((8, 48)), optimizer=opt)
    without_update = predict_step(loss, params, TensorSpec((8, 48)))
    grads = mt.tree.map(torch.randn_like, params)
    state = opt.init(params)
    with Counter(keep_records=False) as counter:
        opt.update(grads, state, params)
    assert counter.flops == predicted.flops - without_update.flops
    # per matrix and step: X X^T, then the two addmms (the tall 48 x 40 runs transposed)
    assert counter.matmul_flops == 4 * 5 * (2 * 40 * 48 * 40 + 2 * 40**3 + 2 * 40 * 40 * 48)
