"""``mt.optim.muon``: torch.optim.Muon step for step over its options (every ``adjust_lr_fn`` the
installed torch takes), the chain it is, and the errors its chain names."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt
from minitrain.optim._muon import muon_lr_ratio
from tests.muon_harness import muon_run_against_torch, torch_accepts

ADJUST_LR_FNS = [None, "original", "match_rms_adamw", "spectral_unclamped"]
# tall, wide and square matrices, three of one shape: ratios above, below and at 1
SHAPES = [(48, 32), (32, 56), (48, 32), (40, 40), (32, 56), (48, 32)]


@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
@pytest.mark.parametrize("kwargs", [
    {},
    {"lr": 0.02, "weight_decay": 0.0, "nesterov": False},
    {"lr": 0.05, "weight_decay": 0.3},
    {"momentum": 0.5, "ns_steps": 3, "eps": 1e-5},
], ids=["defaults", "no-decay-no-nesterov", "decay", "momentum-steps-eps"])
def test_muon_is_torch_optim_muon_step_for_step(kwargs, adjust_lr_fn):
    if not torch_accepts(adjust_lr_fn):
        pytest.skip(f"torch {torch.__version__}'s Muon has no adjust_lr_fn={adjust_lr_fn!r} "
                    f"(spectral_unclamped came in torch 2.14)")
    kwargs = {"ns_steps": 5, **kwargs}
    _, state = muon_run_against_torch(steps=4, shapes=SHAPES, seed=3, adjust_lr_fn=adjust_lr_fn,
                                      **kwargs)
    assert int(state[0][0].count) == int(state[-1].count) == 4


def test_the_lr_ratios_are_torchs():
    """torch's ``_adjust_lr`` for every option the installed torch knows, on tall, wide and
    square shapes; ``spectral_unclamped`` (torch >= 2.14) is ``sqrt(A / B)`` unclamped."""
    from torch.optim._muon import _adjust_lr

    for fn in ADJUST_LR_FNS:
        for shape in [(48, 32), (32, 56), (40, 40), (1, 1024)]:
            if torch_accepts(fn):
                assert muon_lr_ratio(shape, fn) == _adjust_lr(1.0, fn, torch.Size(shape))
    assert muon_lr_ratio((32, 128), "spectral_unclamped") == 0.5
    assert muon_lr_ratio((128, 32), "spectral_unclamped") == 2.0


def test_an_unknown_adjust_lr_fn_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="invalid adjust_lr_fn='spectral'.*spectral_unclamped"):
        mt.optim.muon(adjust_lr_fn="spectral")


def test_muon_takes_empty_and_non_contiguous_matrices():
    """A 0-size matrix (torch steps it) and a transposed grad: torch's result."""
    params = {"empty": torch.zeros(0, 40), "a": torch.randn(40, 48), "b": torch.randn(40, 48)}
    ref = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    grads = {"empty": torch.zeros(0, 40), "a": torch.randn(48, 40).T, "b": torch.randn(40, 48)}
    for k, p in ref.items():
        p.grad = grads[k].clone()
    torch.optim.Muon(list(ref.values()), lr=0.02).step()
    opt = mt.optim.muon(lr=0.02)
    new, _ = opt.update(grads, opt.init(params), params)
    for k, p in ref.items():
        torch.testing.assert_close(new[k], p.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_muon_with_a_schedule_is_its_chain(donate):
    """``muon(...)`` is ``as_optimizer`` of its chain: the same params, state and lr, donated
    or not, whatever lowering may take it."""
    opt = mt.optim.muon(lr=mt.optim.cosine_schedule(0.05, 5), weight_decay=0.1)
    g = torch.Generator().manual_seed(4)
    params = {"a": torch.randn(5, 3, generator=g), "b": torch.randn(3, 3, generator=g)}
    ours, plain = mt.tree.map(torch.clone, params), mt.tree.map(torch.clone, params)
    state, plain_state = opt.init(ours), opt.init(plain)
    chain = opt.update.transformation
    assert [mt.optim.spec(t)[0] for t in mt.optim.spec(chain)[1]["transforms"]] == [
        "chain", "add_decayed_weights", "scale_by_learning_rate"]
    for _ in range(5):
        grads = {k: torch.randn(p.shape, generator=g) for k, p in params.items()}
        ours, state = opt.update(grads, state, ours, donate=donate)
        updates, plain_state = chain.update(grads, plain_state, plain)
        plain = mt.optim.apply_updates(plain, updates)
        for k in params:
            torch.testing.assert_close(ours[k], plain[k], rtol=1e-6, atol=1e-7)
    assert float(state[-1].lr) == float(plain_state[-1].lr)


def _states(opt, params):
    state = opt.init(params)
    return {
        "too short": (state[:2], "chain of 3 transformations got a state of tuple"),
        "a dict": ({"a": 1}, "chain of 3 transformations got a state of dict"),
        "too long": ((*state, state[-1]), "chain of 3 transformations got a state of tuple"),
        "a count for the momentum state": ((state[0][0], *state[1:]),
                                           "muon_momentum expected a MuonMomentumState"),
    }


@pytest.mark.parametrize("case", ["too short", "a dict", "too long",
                                  "a count for the momentum state"])
def test_a_state_init_did_not_return_is_named_by_the_chain(case):
    params = {"w": torch.randn(4, 3)}
    grads = {"w": torch.randn(4, 3)}
    built = {"muon": mt.optim.muon(lr=0.02),
             "as_optimizer": mt.optim.as_optimizer(mt.optim.chain(
                 mt.optim.scale_by_muon(), mt.optim.add_decayed_weights(0.1),
                 mt.optim.scale_by_learning_rate(0.02)))}
    for opt in built.values():
        state, message = _states(opt, params)[case]
        with pytest.raises(ValueError, match=message):
            opt.update(grads, state, params)


def test_keyword_arguments_muon_does_not_take_are_refused():
    opt = mt.optim.muon(lr=0.02)
    params = {"w": torch.randn(4, 3)}
    with pytest.raises(ValueError, match=r"got keyword argument\(s\) \['value'\]"):
        opt.update({"w": torch.randn(4, 3)}, opt.init(params), params, value=1.0)
