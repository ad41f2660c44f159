"""Lookahead (Zhang et al. 2019, "Lookahead Optimizer: k steps forward, 1 step back"), as optax
``lookahead``: a fast optimizer steps the fast params; every ``sync_period`` steps the slow
params move ``slow_step_size`` of the way to the fast ones, and the fast params jump there.
Params and updates are :class:`LookaheadParams` pairs; grads are taken at ``params.fast``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from minitrain import tree
from minitrain.optim._checks import check_state_type, checked, zero_count
from minitrain.optim.base import (
    GradientTransformation,
    check_transformation,
    forwards_extra_args,
    tagged,
)
from minitrain.tree import Params

__all__ = ["lookahead", "LookaheadParams", "LookaheadState"]


class LookaheadParams(NamedTuple):
    """The fast params (take grads here) and the slow ones (evaluate here)."""

    fast: Params
    slow: Params

    @classmethod
    def init_synced(cls, params: Params) -> LookaheadParams:
        """Both halves at ``params``."""
        return cls(fast=params, slow=params)


class LookaheadState(NamedTuple):
    """The fast optimizer's state and the updates since the last sync."""

    fast_state: Any
    steps_since_sync: Tensor


def lookahead(fast_optimizer: GradientTransformation, sync_period: int,
              slow_step_size: float | Tensor,
              reset_state: bool = False) -> GradientTransformation:
    """Lookahead around ``fast_optimizer`` (``reset_state``: re-init its state at each sync).

    >>> import torch, minitrain as mt
    >>> opt = mt.optim.as_optimizer(lookahead(mt.optim.scale(-1.0), 2, 0.5))
    >>> params = LookaheadParams.init_synced([torch.zeros(1)])
    >>> state = opt.init(params)
    >>> for _ in range(2):
    ...     params, state = opt.update([torch.ones(1)], state, params)
    >>> params  # fast: -1, then -2 and synced to slow = 0 + 0.5 (-2 - 0)
    LookaheadParams(fast=[tensor([-1.])], slow=[tensor([-1.])])
    """
    check_transformation(fast_optimizer, "lookahead's fast_optimizer")
    if isinstance(sync_period, bool) or not isinstance(sync_period, int) or sync_period < 1:
        raise ValueError(f"invalid sync_period={sync_period!r}: pass an int >= 1")
    slow_step_size = checked("slow_step_size", slow_step_size, 0.0, 1.0)

    def init(params):
        fast = params.fast if isinstance(params, LookaheadParams) else params
        return LookaheadState(fast_optimizer.init(fast), zero_count())

    def update(updates, state, params=None, **extra):
        check_state_type("lookahead", LookaheadState, state)
        if not isinstance(params, LookaheadParams):
            raise ValueError("lookahead needs params=LookaheadParams(fast, slow) (see "
                             "LookaheadParams.init_synced), with grads taken at params.fast")
        updates, fast_state = fast_optimizer.update(updates, state.fast_state, params.fast,
                                                    **extra)
        sync = state.steps_since_sync == sync_period - 1
        # optax _lookahead_update: d = fast + u - slow; slow += a d; fast += u - (1 - a) d
        diff = tree.map(lambda f, u, s: f + u - s, params.fast, updates, params.slow)
        slow = tree.map(lambda d: d * (sync.to(d.dtype) * slow_step_size), diff)
        fast = tree.map(lambda u, d: u - d * (sync.to(d.dtype) * (1 - slow_step_size)),
                        updates, diff)
        if reset_state:
            fresh = fast_optimizer.init(params.fast)
            fast_state = tree.map(lambda now, new: torch.where(sync, new, now), fast_state, fresh)
        return LookaheadParams(fast, slow), LookaheadState(
            fast_state, (state.steps_since_sync + 1) % sync_period)

    forwards_extra_args(update, [fast_optimizer])
    return tagged("lookahead", GradientTransformation(init, update), inner=fast_optimizer,
                  sync_period=sync_period, slow_step_size=slow_step_size)
