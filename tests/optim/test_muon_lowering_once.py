"""``mt.optim.muon(...)`` builds its lowering once, and a state its init did not return is named
by the chain (not by an unpacking error in a second, unused lowering)."""

import pytest
import torch

import minitrain as mt
from minitrain.optim import _muon


@pytest.fixture
def counted(monkeypatch):
    """Every lowering :func:`_muon._match` builds (one parse, one pool each), counted."""
    parses, pools = [], []
    real_parse = _muon.chain_lowering

    def parse(*args, **kwargs):
        parses.append(args)
        return real_parse(*args, **kwargs)

    class Pool(_muon.BufferPool):
        def __init__(self):
            super().__init__()
            self.updates = 0
            pools.append(self)

        def begin_update(self):
            self.updates += 1
            super().begin_update()

    monkeypatch.setattr(_muon, "chain_lowering", parse)
    monkeypatch.setattr(_muon, "BufferPool", Pool)
    return parses, pools


def test_muon_builds_its_lowering_once_and_updates_with_it(counted):
    parses, pools = counted
    opt = mt.optim.muon(lr=0.02)
    assert (len(parses), len(pools)) == (1, 1)
    params = {"w": torch.randn(8, 4), "v": torch.randn(4, 4)}
    grads = {"w": torch.randn(8, 4), "v": torch.randn(4, 4)}
    state = opt.init(params)
    new, new_state = opt.update(grads, state, params)
    assert pools[0].updates == 1  # the update ran the lowering built at construction
    assert (len(parses), len(pools)) == (1, 1)
    # the same step as the chain it lowers
    tx = opt.update.transformation
    updates, _ = tx.update(grads, state, params)
    for key in params:
        torch.testing.assert_close(new[key], params[key] + updates[key])


def test_maximize_builds_no_lowering(counted):
    parses, pools = counted
    mt.optim.muon(lr=0.02, maximize=True)
    assert len(pools) == 0 and len(parses) == 1  # parsed once, matched no lowering


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
                 _muon.scale_by_muon(), mt.optim.add_decayed_weights(0.1),
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
