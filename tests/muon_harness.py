"""Muon's fast path against torch.optim.Muon, step by step (shared by the Muon tests)."""

from __future__ import annotations

import torch

import minitrain as mt


def muon_run_against_torch(steps=3, shapes=((40, 48),) * 4, zero_first=False, ns_steps=5):
    """Muon's fast path and torch.optim.Muon side by side; asserts equal params each step
    (``zero_first``: the first grads are zeros, as for a zero-initialised projection;
    ``ns_steps``: Newton-Schulz iterations, both sides)."""
    g = torch.Generator().manual_seed(5)
    params = {f"m{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    ref = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    torch_opt = torch.optim.Muon(list(ref.values()), lr=0.02, ns_steps=ns_steps)
    opt = mt.optim.muon(lr=0.02, ns_steps=ns_steps)
    ours, state = params, opt.init(params)
    for step in range(steps):
        grads = {k: torch.randn(p.shape, generator=g) * (step > 0 or not zero_first)
                 for k, p in params.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        ours, state = opt.update(grads, state, ours)
        for k, p in ref.items():
            assert torch.equal(ours[k], p.detach()), k
