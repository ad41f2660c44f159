"""Muon's Newton-Schulz iteration: torch's ``_zeropower_via_newtonschulz`` bit for bit, for one
matrix and for stacks of same-shape matrices (stacked only where a probe proved the batched
kernels round alike), counted and predicted one matrix at a time."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

import minitrain as mt
from minitrain.optim import _newton_schulz as ns
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


@pytest.mark.parametrize("stack_bytes", [None, 2 * 2 * 48 * 32], ids=["one_stack", "stacks_of_2"])
def test_stacks_of_same_shape_matrices_keep_torchs_bits(stack_bytes, monkeypatch):
    """Tall, wide and square matrices, several of one shape: one batched run per stack (at
    most ``STACK_BYTES``), each matrix's direction torch's own."""
    matrices = [torch.zeros(s) for s in SHAPES]
    want = [[0, 2, 5], [1, 4], [3]] if stack_bytes is None else [[0, 2], [5], [1], [4], [3]]
    assert ns.same_shape_stacks(matrices, stack_bytes) == want
    if stack_bytes is not None:
        monkeypatch.setattr(ns, "STACK_BYTES", stack_bytes)
    muon_run_against_torch(steps=3, shapes=SHAPES, seed=3)


def _counting_newton_schulz(monkeypatch, batched_result):
    """Replace Newton-Schulz by one that counts its 2-D and stacked calls and computes a
    stack with ``batched_result(stack, one_at_a_time)``."""
    calls = []
    one = ns.newton_schulz

    def counted(x, *args):
        calls.append(x.dim())
        if x.dim() == 2:
            return one(x, *args)
        return batched_result(x, torch.stack([one(m, *args) for m in x.unbind(0)]))

    monkeypatch.setattr(ns, "newton_schulz", counted)
    monkeypatch.setattr(ns, "_STACK_IS_EXACT", {})
    return calls


def test_muon_stacks_same_shape_matrices_once_a_batched_run_proved_exact(monkeypatch):
    calls = _counting_newton_schulz(monkeypatch, lambda stack, alone: alone)
    muon_run_against_torch(steps=3)
    # step 1 first tries random matrices of the stack's shape both ways, then every step
    # runs the stack in one batched run (twice: the optimizer, and the harness's directions)
    assert calls == [3] + [2] * 4 + [3] * 6
    assert list(ns._STACK_IS_EXACT.values()) == [True]


def test_muon_runs_one_matrix_at_a_time_where_a_batched_run_rounds_differently(monkeypatch):
    """A GEMM library whose batched kernels round differently costs the stacking, never the
    bits: the directions stay torch's."""
    calls = _counting_newton_schulz(
        monkeypatch, lambda stack, alone: alone + torch.finfo(torch.bfloat16).eps
    )
    muon_run_against_torch(steps=3)
    assert calls == [3, 2] + [2] * 24  # the probe stops at the first matrix that differs
    assert list(ns._STACK_IS_EXACT.values()) == [False]


def test_a_first_update_of_zeros_does_not_decide_the_stacking(monkeypatch):
    """Zero grads (a zero-initialised projection) round alike either way: the probe runs on
    random matrices, so a batched kernel that rounds other values differently is caught."""
    _counting_newton_schulz(
        monkeypatch, lambda stack, alone: alone + torch.finfo(torch.bfloat16).eps * alone.ne(0)
    )
    muon_run_against_torch(steps=2, zero_first=True)
    assert list(ns._STACK_IS_EXACT.values()) == [False]


def test_muon_stacks_are_exact_on_this_machines_gemms_or_not_taken():
    """The real kernels, over shapes where oneDNN's batched bfloat16 GEMMs were seen to round
    both ways (tall, wide, one side of 17, tiny): torch's directions either way."""
    muon_run_against_torch(steps=2, shapes=[(300, 17)] * 8 + [(5, 12)] * 2 + [(64, 96)] * 3
                           + [(96, 64)] * 3)


def test_muon_stacks_are_predicted_and_counted_one_matrix_at_a_time(monkeypatch):
    """The step predictor (meta and fake tensors) and the accounting Counter see Muon's
    one-at-a-time ops, whatever a real update learned: the prediction equals the count, and
    nothing is probed (counted twice) under them."""
    from minitrain.accounting import Counter
    from minitrain.accounting.predict import TensorSpec, predict_step

    monkeypatch.setattr(ns, "_STACK_IS_EXACT", {})
    params = {f"w{i}": torch.randn(48, 40) for i in range(4)}
    loss = lambda p, x: sum((x @ w).tanh().sum() for w in p.values())  # noqa: E731
    opt = mt.optim.muon(lr=0.02)
    predicted = predict_step(loss, params, TensorSpec((8, 48)), optimizer=opt)
    without_update = predict_step(loss, params, TensorSpec((8, 48)))
    assert ns._STACK_IS_EXACT == {}
    assert "aten.bmm" not in predicted.per_op
    grads = mt.tree.map(torch.randn_like, params)
    state = opt.init(params)
    opt.update(grads, state, params)  # a real update: probes the stack once
    assert len(ns._STACK_IS_EXACT) == 1
    with Counter(keep_records=False) as counter:
        opt.update(grads, state, params)
    assert counter.flops == predicted.flops - without_update.flops
    assert "aten.bmm" not in str(counter.flop_counts())
    monkeypatch.setattr(ns, "_STACK_IS_EXACT", {})
    with Counter(keep_records=False) as first:  # a first update, counted: not probed
        opt.update(grads, state, params)
    assert first.flops == counter.flops and ns._STACK_IS_EXACT == {}
    # per matrix and step: X X^T, then the two addmms (the tall 48 x 40 runs transposed)
    assert counter.matmul_flops == 4 * 5 * (2 * 40 * 48 * 40 + 2 * 40**3 + 2 * 40 * 40 * 48)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_stacking_probe_is_redone_for_another_cuda_gemm_library(monkeypatch):
    """cuBLAS and cuBLASLt may round a batched run differently: the probe's cache key holds
    the GEMM library torch prefers."""
    _counting_newton_schulz(monkeypatch, lambda stack, alone: alone)
    assert "cublas" in ns._blas_library().lower()  # the real query, before it is replaced
    matrices = [torch.randn(64, 64, device="cuda") for _ in range(2)]
    for library in ("cublas", "cublaslt"):
        monkeypatch.setattr(ns, "_blas_library", lambda library=library: library)
        ns.newton_schulz_each(matrices)
    assert len(ns._STACK_IS_EXACT) == 2
