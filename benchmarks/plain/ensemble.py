"""A deep ensemble in plain PyTorch: 8 MLPs trained as one, each with its own learning rate.

The plain torch.func equivalent of examples/ensemble.py. The members' params are stacked along a
leading member axis each step, ``torch.func.vmap`` runs the eight forward passes as one, one
backward fills each member's grads, and one ``torch.optim.Adam`` with a param group per member
(lrs log-spaced over 1e-3..1e-1) updates them. The task is regression of
``y = sin(3 x0) cos(2 x1)`` plus noise of std 0.1 from 256 fixed points; on 1024 held-out points
it reports each member's MSE and that of the ensemble's mean prediction.

    python benchmarks/plain/ensemble.py              # 500 steps (--steps N for N)
    python benchmarks/plain/ensemble.py --compile    # the step under torch.compile
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

MEMBERS, HIDDEN, STEPS = 8, 64, 500


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, 1))


def stacked(members: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Each param of the members stacked along a new leading axis; grads flow back to them."""
    return {name: torch.stack([m.get_parameter(name) for m in members])
            for name, _ in members[0].named_parameters()}


def predict(model: nn.Module, params: dict, x: torch.Tensor) -> torch.Tensor:
    return functional_call(model, params, (x,)).squeeze(-1)


def loss(model: nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(predict(model, params, x), y)


member_losses = vmap(loss, in_dims=(None, 0, None, None))


def train_step(members, adam, x, y):
    losses = member_losses(members[0], stacked(members), x, y)
    adam.zero_grad()
    losses.sum().backward()
    adam.step()
    return losses.detach()


def data(points: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.rand(points, 2, generator=g) - 1
    noise = 0.1 * torch.randn(points, generator=g)
    return x, torch.sin(3 * x[:, 0]) * torch.cos(2 * x[:, 1]) + noise


def main(steps: int = STEPS, compile: bool = False) -> dict:
    """Train the ensemble; each member's and the ensemble's held-out MSE."""
    lrs = torch.logspace(-3, -1, MEMBERS)
    torch.manual_seed(0)
    members = [mlp() for _ in range(MEMBERS)]
    adam = torch.optim.Adam([{"params": m.parameters(), "lr": lr}
                             for m, lr in zip(members, lrs.tolist(), strict=True)])
    step = torch.compile(train_step) if compile else train_step
    (x, y), (x_test, y_test) = data(256, seed=0), data(1024, seed=1)
    for _ in range(steps):
        losses = step(members, adam, x, y)
    with torch.no_grad():
        preds = vmap(predict, in_dims=(None, 0, None))(members[0], stacked(members), x_test)
    return {"lr": lrs.tolist(), "train_mse": losses.tolist(),
            "member_mse": ((preds - y_test) ** 2).mean(1).tolist(),
            "ensemble_mse": float(((preds.mean(0) - y_test) ** 2).mean())}


if __name__ == "__main__":
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else STEPS
    result = main(steps, compile="--compile" in sys.argv)
    for lr, mse in zip(result["lr"], result["member_mse"], strict=True):
        print(f"lr {lr:.4f}  held-out mse {mse:.4f}")
    print(f"ensemble mean     held-out mse {result['ensemble_mse']:.4f}")
