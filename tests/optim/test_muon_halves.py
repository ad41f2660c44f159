"""Muon's Newton-Schulz with its symmetric products in halves (large matrices): torch's bits,
taken only where a check on random matrices proved them equal."""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from minitrain.optim import _muon
from tests.muon_harness import muon_run_against_torch

COEFFICIENTS = _muon.NS_COEFFICIENTS


def _against_torch(shapes, steps=2, ns_steps=5):
    muon_run_against_torch(steps=steps, shapes=shapes, ns_steps=ns_steps)


@pytest.mark.parametrize("shape", [(64, 64), (65, 48), (48, 97), (33, 33)])
@pytest.mark.parametrize("steps", [5, 2])
def test_halves_compute_torchs_newton_schulz_where_the_check_says_so(shape, steps):
    """Whatever this machine's GEMMs do, the check's verdict is right for its probe, and
    where it says exact the halves give torch's own function's bits on other data too."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    exact = _muon._halves_are_exact(x, COEFFICIENTS, steps, _muon.EPS)
    probe = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    same = torch.equal(_muon._newton_schulz_halves(probe, COEFFICIENTS, steps, _muon.EPS),
                       _zeropower_via_newtonschulz(probe, COEFFICIENTS, steps, _muon.EPS))
    assert exact == same
    if exact:
        assert torch.equal(_muon._newton_schulz_halves(x, COEFFICIENTS, steps, _muon.EPS),
                           _zeropower_via_newtonschulz(x, COEFFICIENTS, steps, _muon.EPS))


def test_large_matrices_take_the_halves_and_keep_torchs_bits(monkeypatch):
    monkeypatch.setattr(_muon, "HALVES_MIN_SIDE", 64)
    monkeypatch.setattr(_muon, "_HALVES_ARE_EXACT", {})
    taken = []
    halves = _muon._newton_schulz_halves
    monkeypatch.setattr(_muon, "_newton_schulz_halves",
                        lambda g, *a: taken.append(tuple(g.shape)) or halves(g, *a))
    _against_torch([(64, 80)] * 3 + [(96, 64), (40, 48)])
    checked = list(_muon._HALVES_ARE_EXACT.values())
    assert len(checked) == 2  # one check per shape of 64 or more on both sides
    if all(checked):  # 2 steps x (3 + 1) matrices, plus two probes per shape
        assert len(taken) == 2 * 4 + 2 * 2 and (40, 48) not in taken


def test_halves_that_round_differently_are_never_taken(monkeypatch):
    """A GEMM library whose half-size products round differently costs the saving, never the
    bits: the check refuses them and the result stays torch's."""
    monkeypatch.setattr(_muon, "HALVES_MIN_SIDE", 64)
    monkeypatch.setattr(_muon, "_HALVES_ARE_EXACT", {})
    halves = _muon._newton_schulz_halves
    monkeypatch.setattr(_muon, "_newton_schulz_halves", lambda g, *a: halves(g, *a) + 2**-8)
    _against_torch([(64, 80)] * 2)
    assert list(_muon._HALVES_ARE_EXACT.values()) == [False]


def test_a_1024_matrix_equals_torch_optim_muon():
    """The size the halves are for (HALVES_MIN_SIDE), with the real threshold. One
    Newton-Schulz iteration (each runs the same GEMMs): without native bfloat16 GEMMs, five
    take over a minute at this size, with the probes."""
    _against_torch([(1024, 1024)], steps=1, ns_steps=1)
