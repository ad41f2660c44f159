"""DP-SGD (Abadi et al. 2016, Algorithm 1) in plain PyTorch: the equivalent of examples/dp_sgd.py.

Per-example gradients from one ``vmap(grad)``, each clipped to L2 norm ``clip``, summed, noised
with std ``noise_multiplier * clip`` and averaged; then SGD. An MLP 20-64-10 learns 10-way
Gaussian points labelled by a random linear teacher; held-out accuracy at the end.
What ``minitrain run`` adds (checkpoints, resume, metrics files, the lr and grad norm it logs,
reports) is not reproduced.

    python benchmarks/plain/dp_sgd.py [--steps N]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

CONFIG = {
    "batch_size": 64,
    "clip": 1.0,
    "noise_multiplier": 1.1,
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


def private_gradient(grads: dict, clip: float, noise_multiplier: float,
                     generator: torch.Generator) -> tuple[dict, torch.Tensor]:
    """Clip each example's gradient, sum, add noise, average; and the fraction clipped."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
    scale = clip / norms.clamp(min=clip)
    private = {
        name: (torch.tensordot(scale, g, dims=1)
               + noise_multiplier * clip * torch.randn(g.shape[1:], generator=generator))
        / len(norms)
        for name, g in grads.items()
    }
    return private, (norms > clip).float().mean()


def main(config: dict) -> None:
    x_train, y_train = dataset(config["train_points"], seed=1)
    x_test, y_test = dataset(2048, seed=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, config["hidden"]), nn.ReLU(),
                          nn.Linear(config["hidden"], 10))
    params = {name: p.detach() for name, p in model.named_parameters()}

    def example_loss(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    per_example = vmap(grad_and_value(example_loss), in_dims=(None, 0, 0))
    data, noise = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    for step in range(1, config["steps"] + 1):
        rows = torch.randint(0, len(x_train), (config["batch_size"],), generator=data)
        grads, losses = per_example(params, x_train[rows], y_train[rows])
        private, clipped = private_gradient(grads, config["clip"], config["noise_multiplier"],
                                            noise)
        params = {name: p - config["lr"] * private[name] for name, p in params.items()}
        print(f"step {step}  loss {losses.mean():.4f}  clipped {clipped:.3f}")
    logits = functional_call(model, params, (x_test,))
    print(f"accuracy {(logits.argmax(1) == y_test).float().mean():.4f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    steps = int(args[args.index("--steps") + 1]) if "--steps" in args else CONFIG["steps"]
    main({**CONFIG, "steps": steps})
