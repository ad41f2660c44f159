"""``impl="compiled"`` for the family: a chain's whole update over all leaves as one inductor
graph (``torch.compile``), written straight into recycled buffers.

The graph runs the rule's own ``update_leaf`` (with every hyperparameter and per-step scalar a
0-d tensor of the leaves' dtype, so a new step or lr does not recompile) and the chain around
it: ``-g`` when maximizing, L2 or decoupled weight decay, ``-lr``. Inductor fuses each leaf's
ops into one loop that reads params, grads and state once and writes the new ones once: the
fewest passes over memory a pure update can make. The first update of each new set of leaf
shapes compiles (seconds). Leaves of mixed dtypes take the uncompiled fast path.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from minitrain.optim._host import host_tensor

__all__ = ["CompiledChain"]


def _scalar(value: Any, dtype: torch.dtype) -> Tensor:
    return host_tensor(value, dtype).detach().reshape(())


class CompiledChain:
    """One family chain's update as a compiled graph (see the module docstring)."""

    def __init__(self, update_leaf: Callable[..., Any], maximize: bool, l2: bool,
                 decoupled: bool, scaled: bool) -> None:
        self.update_leaf = update_leaf
        self.maximize, self.l2, self.decoupled, self.scaled = maximize, l2, decoupled, scaled
        self.kernel: Callable[..., None] | None = None

    def __call__(self, ps, gs, buffers, step, hyper, per_step, lr, weight_decay, flags,
                 ps_out, buffers_out) -> None:
        if self.kernel is None:
            # A code object of its own: dynamo's recompile limit counts per code object, and
            # each optimizer (rule, flags, leaf shapes) is a graph of its own.
            code = CompiledChain._into.__code__.replace()
            into = types.MethodType(types.FunctionType(code, globals(), "_into"), self)
            self.kernel = torch.compile(into, dynamic=False, fullgraph=True)
        dtype = ps[0].dtype  # one dtype for all leaves (the caller checks)

        def tensors(values: dict) -> dict:
            return {k: _scalar(v, dtype) for k, v in values.items()}

        self.kernel(ps, gs, buffers, _scalar(step, dtype), tensors(hyper), tensors(per_step),
                    _scalar(lr, dtype), _scalar(weight_decay, dtype), tuple(flags), ps_out,
                    buffers_out)

    def _into(self, ps, gs, buffers, step, hyper, per_step, lr, weight_decay, flags, ps_out,
              buffers_out) -> None:
        for i, (p, g) in enumerate(zip(ps, gs, strict=True)):
            u = g * -1.0 if self.maximize else g
            if self.l2 and flags[i]:
                u = (u + weight_decay * p).to(g.dtype)
            out, new = self.update_leaf(u, {k: v[i] for k, v in buffers.items()}, p, step,
                                        **hyper, **per_step)
            base = p * (1 - lr * weight_decay) if self.decoupled and flags[i] else p
            ps_out[i].copy_(base - lr * out if self.scaled else base + out)
            for key, leaves in buffers_out.items():
                leaves[i].copy_(new[key])
