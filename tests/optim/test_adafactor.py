"""``mt.optim.adafactor``: torch.optim.Adafactor step for step on a large matrix, small and 0-d
to 3-d leaves, with a schedule (torch's StepLR), pure and donated; the alias is its chain."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt

ADAFACTOR = [dict(), dict(weight_decay=0.1, maximize=True),
             dict(lr=mt.optim.step_schedule(0.05, 2, gamma=0.5), beta2_decay=-0.5,
                  eps=(1e-30, 1e-2), d=2.0)]
# a matrix with a ragged row, a small one, and 1-D, 0-d and 3-D leaves
SHAPES = [(300, 257), (64, 3), (33,), (), (2, 3, 4)]


def _torch_run(kwargs, params, grads_seq):
    reference = dict(kwargs)
    if callable(reference.get("lr")):
        reference["lr"] = 0.05  # the schedule as torch's StepLR, stepped below
    leaves = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = torch.optim.Adafactor(leaves, **reference)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5) \
        if callable(kwargs.get("lr")) else None
    for grads in grads_seq:
        for p, grad in zip(leaves, grads, strict=True):
            p.grad = grad.clone()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return [p.detach() for p in leaves]


@pytest.mark.parametrize("kwargs", ADAFACTOR, ids=["default", "decay-maximize", "schedule"])
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_adafactor_matches_torch_and_its_chain(kwargs, donate):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in SHAPES]
    grads_seq = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(5)]
    opt = mt.optim.adafactor(**kwargs)
    ours, state = [p.clone() for p in params], opt.init(params)
    for grads in grads_seq:
        snapshot = [t.clone() for t in grads]
        pointer = ours[0].data_ptr()
        new, state = opt.update(grads, state, ours, donate=donate)
        assert (new[0].data_ptr() == pointer) == donate
        assert all(torch.equal(a, b) for a, b in zip(snapshot, grads, strict=True))
        ours = new
    transformation = opt.update.transformation
    theirs, chain_state = [p.clone() for p in params], transformation.init(params)
    for grads in grads_seq:
        updates, chain_state = transformation.update(grads, chain_state, theirs)
        theirs = mt.optim.apply_updates(theirs, updates)
    for a, b in zip(mt.tree.leaves((ours, state)), mt.tree.leaves((theirs, chain_state)),
                    strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for mine, expected in zip(ours, _torch_run(kwargs, params, grads_seq), strict=True):
        torch.testing.assert_close(mine, expected, rtol=1e-5, atol=1e-6)


def test_adafactor_factors_the_last_two_dims_as_the_paper_does():
    """Shazeer & Stern (2018), Algorithm 4 with torch's choices: ``R = lerp(R, mean_n(g²))``,
    ``C = lerp(C, mean_m(g²))``, ``V = R C / mean(R)``, ``U = g / sqrt(V)`` clipped to RMS
    ``d``, the step ``max(eps2, RMS(p)) min(lr, 1/sqrt(t))``, on a 3-D leaf per matrix."""
    g = torch.Generator().manual_seed(1)
    p, grad = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    tx = mt.optim.scale_by_adafactor(lr=0.05)
    updates, state = tx.update([grad], tx.init([p]), [p])
    # 1 - beta2_t = t^-0.8 = 1 at t = 1: the first moments are the first means
    rows = (grad * grad).mean(-1, keepdim=True)
    cols = (grad * grad).mean(-2, keepdim=True)
    torch.testing.assert_close(state.row_var[0], rows)
    torch.testing.assert_close(state.col_var[0], cols)
    scaled = grad / (rows @ cols / rows.mean(-2, keepdim=True)).sqrt()
    clip = max(1.0, float(scaled.pow(2).mean().sqrt()))
    step = max(1e-3, float(p.pow(2).mean().sqrt())) * min(0.05, 1.0)
    torch.testing.assert_close(updates[0], -step * scaled / clip)
