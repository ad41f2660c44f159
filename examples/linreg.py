"""Linear regression, the chapter's training loop (3.5.7).

The target is ``y = x @ true_w`` with ``true_w = arange(D)``; every step draws a fresh batch
of Gaussian ``x``. The model is a Cruncher with no hidden layers (one D×1 weight), trained with
plain SGD on the mean squared error.

    minitrain run examples/linreg.py                            # lr 0.01, 1000 steps
    minitrain run examples/linreg.py --set lr=0.1 --steps 300   # the chapter's faster lr
    minitrain run examples/linreg.py --set lr=0.01 --steps 10   # ...and its slow start
"""

import torch

import minitrain as mt

CONFIG = {
    "dim": 16,  # D
    "num_layers": 0,  # hidden D×D layers; 0 is plain linear regression
    "batch_size": 4,  # B
    "lr": 0.01,
    "steps": 1000,
}


def experiment(config: dict) -> mt.Experiment:
    dim, batch_size = config["dim"], config["batch_size"]
    true_w = torch.arange(dim, dtype=torch.float32)

    def init(generator: torch.Generator) -> dict:
        return mt.models.cruncher_init(
            dim=dim, num_layers=config["num_layers"], generator=generator
        )

    def next_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, dim, generator=generator)
        return x, x @ true_w

    def loss(params: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return mt.losses.mse(mt.models.cruncher(params, x), y)

    return mt.Experiment(
        name="linreg",
        init=init,
        loss=loss,
        next_batch=next_batch,
        optimizer=mt.optim.sgd(lr=config["lr"]),
        steps=config["steps"],
        # Exact matmul FLOPs: forward 2·B·P, weight grads 2·B·P, and input grads for every layer
        # but the first (the data needs no gradient).
        flops_per_step=mt.accounting.cruncher_flops(batch_size, dim, config["num_layers"]),
    )
