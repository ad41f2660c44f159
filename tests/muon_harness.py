"""mt.optim.muon against torch.optim.Muon, step by step (shared by the Muon tests)."""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

import minitrain as mt

# The params after each update: torch shrinks the param, then adds the scaled direction; the
# chain adds one update. The momentum buffers and the directions carry torch's bits.
RTOL, ATOL = 1e-6, 1e-7


def torch_accepts(adjust_lr_fn: str | None) -> bool:
    """Whether the installed torch.optim.Muon takes this ``adjust_lr_fn``."""
    try:
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn=adjust_lr_fn)
    except ValueError:
        return False
    return True


def muon_run_against_torch(steps=3, shapes=((40, 48),) * 4, zero_first=False, ns_steps=5,
                           seed=5, **kwargs):
    """mt.optim.muon and torch.optim.Muon side by side (``zero_first``: the first grads are
    zeros, as for a zero-initialised projection; ``ns_steps`` and ``kwargs`` go to both).
    Each step: the momentum buffers equal torch's, the orthogonalized directions
    (``scale_by_muon``) equal torch's ``_zeropower_via_newtonschulz`` times its lr ratio, bit
    for bit, and the params are close to torch's. Returns the last params and state."""
    kwargs = {"lr": 0.02, **kwargs, "ns_steps": ns_steps}
    g = torch.Generator().manual_seed(seed)
    params = {f"m{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    ref = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    torch_opt = torch.optim.Muon(list(ref.values()), **kwargs)
    opt = mt.optim.muon(**kwargs)
    direction = mt.optim.scale_by_muon(**{k: v for k, v in kwargs.items()
                                          if k not in ("lr", "weight_decay")})
    ours, state, direction_state = params, opt.init(params), direction.init(params)
    for step in range(steps):
        grads = {k: torch.randn(p.shape, generator=g) * (step > 0 or not zero_first)
                 for k, p in params.items()}
        for k, p in ref.items():
            p.grad = grads[k].clone()
        torch_opt.step()
        ours, state = opt.update(grads, state, ours)
        directions, direction_state = direction.update(grads, direction_state, params)
        group = torch_opt.param_groups[0]
        for k, p in ref.items():
            buf = torch_opt.state[p]["momentum_buffer"]
            assert torch.equal(state[0][0].momentum_buffer[k], buf), k
            nesterov = grads[k].lerp(buf, group["momentum"]) if group["nesterov"] else buf
            ortho = _zeropower_via_newtonschulz(nesterov, group["ns_coefficients"],
                                                group["ns_steps"], group["eps"])
            ratio = _adjust_lr(1.0, group["adjust_lr_fn"], p.shape)
            assert torch.equal(directions[k], ortho.float() * ratio), k
            torch.testing.assert_close(ours[k], p.detach(), rtol=RTOL, atol=ATOL)
    return ours, state
