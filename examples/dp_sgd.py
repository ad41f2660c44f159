"""DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy", Algorithm 1).

Each example's gradient is clipped to L2 norm ``clip``, the clipped gradients are summed,
Gaussian noise of std ``noise_multiplier * clip`` is added, and the sum is divided by the batch
size: ``mt.optim.differentially_private_aggregate`` (optax's), drawing its noise from the step's
key (``uses_key``: ``fold_in(key(seed), step)``, so a resumed run draws the same noise). The
per-example gradients come from one ``vmap(grad)``. The loss returns the batch's mean loss with
the private gradient as its gradient, so ``minitrain run`` trains it with plain SGD and gets
checkpoints, resume and metrics as any run; ``clipped`` logs the fraction of clipped examples.

The task: 10-way classification of 20-dimensional Gaussian points labelled by a fixed random
linear teacher, learnt by an MLP 20-64-10 from 8192 training points. After the default 1000
steps, held-out accuracy is about 0.9 (0.1 by chance). No privacy accounting here: the epsilon
of a run follows from the sampling rate, ``noise_multiplier`` and the steps (Mironov 2017).

    minitrain run examples/dp_sgd.py
    minitrain run examples/dp_sgd.py --set noise_multiplier=0 --set clip=1e9   # plain SGD
"""

import torch

import minitrain as mt

CONFIG = {
    "batch_size": 64,
    "clip": 1.0,  # C, the per-example L2 norm bound
    "noise_multiplier": 1.1,  # sigma: the noise std is sigma * C
    "lr": 0.5,
    "hidden": 64,
    "train_points": 8192,
    "steps": 1000,
}


def dataset(points: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian points labelled by the argmax of a fixed random linear teacher."""
    teacher = torch.randn(20, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(points, 20, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(1)


def init(key: torch.Tensor, hidden: int) -> list[dict]:
    k1, k2 = mt.random.split(key)
    return [mt.nn.linear_init(k1, 20, hidden), mt.nn.linear_init(k2, hidden, 10)]


def predict(params: list[dict], x: torch.Tensor) -> torch.Tensor:
    return mt.nn.linear(params[1], torch.relu(mt.nn.linear(params[0], x)))


def example_loss(params: list[dict], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return mt.losses.cross_entropy(predict(params, x), y)


def with_gradient(value: torch.Tensor, params, grads) -> torch.Tensor:
    """``value``, whose gradient with respect to ``params`` is ``grads``."""
    dot = sum((p * g).sum() for p, g in zip(mt.tree.leaves(params), mt.tree.leaves(grads),
                                            strict=True))
    return value.detach() + dot - dot.detach()


def experiment(config: dict) -> mt.Experiment:
    x_train, y_train = dataset(config["train_points"], seed=1)
    x_test, y_test = dataset(2048, seed=2)
    per_example = mt.vmap(mt.value_and_grad(example_loss), in_dims=(None, 0, 0))
    private = mt.optim.differentially_private_aggregate(config["clip"], config["noise_multiplier"],
                                                        key=0)  # the key: each step's, below

    def loss(params: list[dict], batch: tuple, *, key: torch.Tensor) -> tuple:
        losses, grads = per_example(mt.tree.map(torch.detach, params), *batch)
        private_grads, _ = private.update(grads, mt.optim.DifferentiallyPrivateAggregateState(key))
        clipped = (mt.tree.per_example_global_norm(grads) > config["clip"]).float().mean()
        return with_gradient(losses.mean(), params, private_grads), {"clipped": clipped}

    def next_batch(generator: torch.Generator) -> tuple:
        rows = torch.randint(0, len(x_train), (config["batch_size"],), generator=generator)
        return x_train[rows], y_train[rows]

    def evaluate(params: list[dict]) -> dict:
        return {"accuracy": float((predict(params, x_test).argmax(1) == y_test).float().mean())}

    return mt.Experiment(
        name="dp_sgd", loss=loss, has_aux=True, uses_key=True, next_batch=next_batch,
        init=lambda g: init(mt.random.key(g), config["hidden"]),
        optimizer=mt.optim.sgd(lr=config["lr"]), steps=config["steps"], evaluate=evaluate)
