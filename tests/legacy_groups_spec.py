"""The optimizer and params of ``tests/data/legacy_groups/``: a checkpoint that minitrain wrote
when ``multi_transform`` and ``masked`` kept each group's state as a list (commit 9dac18a)."""

import torch

import minitrain as mt
from minitrain import optim


def build() -> optim.Optimizer:
    """AdamW on the matrices, its decay masked to those with 3 rows; momentum SGD on the rest."""
    adam = optim.chain(optim.scale_by_adam(),
                       optim.masked(optim.add_decayed_weights(0.1),
                                    lambda name, p: p.shape[0] == 3),
                       optim.scale_by_learning_rate(0.01))
    sgd = optim.chain(optim.trace(0.9), optim.scale_by_learning_rate(0.1))
    return optim.as_optimizer(optim.multi_transform(
        {"adam": adam, "sgd": sgd}, lambda name, p: "adam" if p.ndim == 2 else "sgd"))


def params0() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"layer": {"w": torch.randn(3, 2, generator=g), "b": torch.randn(2, generator=g)},
            "head": {"w": torch.randn(2, 1, generator=g), "scale": torch.randn(1, generator=g)}}


def grads(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return mt.tree.map(lambda p: torch.randn(p.shape, generator=g), params0())
