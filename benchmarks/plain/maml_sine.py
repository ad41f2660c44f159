"""MAML on sine-wave regression (Finn et al. 2017, section 5.1) in plain PyTorch.

The plain torch.func + torch.optim equivalent of examples/maml_sine.py: the same sine tasks, MLP
1-40-40-1, second-order MAML (``inner_steps`` SGD updates on the support points, vmapped over the
tasks of a meta-batch), Adam on the post-adaptation query loss, and the evaluation on 100 fixed
held-out tasks. What ``minitrain run`` adds (checkpoints, resume, metrics files, resource report,
progress bar) is left out: one line per step and the evaluations are printed.

    python benchmarks/plain/maml_sine.py [--steps N]
"""

import argparse
import math

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

HIDDEN = 40
TASKS = 25  # tasks per meta-batch (Finn et al.: 25)
SUPPORT = 10  # K-shot: points the model adapts on, and as many query points (Finn et al.: 10)
INNER_STEPS = 1  # SGD updates per adaptation
INNER_LR = 0.01  # Finn et al.: 0.01
LR = 1e-3  # outer Adam lr (Finn et al.: 1e-3)
STEPS = 1500
EVAL_TASKS = 100
EVAL_EVERY = 500


def sample_tasks(tasks: int, points: int, generator: torch.Generator) -> tuple:
    """``tasks`` sine waves: (x, y) of ``points`` support and ``points`` query samples each."""
    amplitude = 0.1 + 4.9 * torch.rand(tasks, 1, 1, generator=generator)
    phase = math.pi * torch.rand(tasks, 1, 1, generator=generator)
    x = -5.0 + 10.0 * torch.rand(tasks, 2 * points, 1, generator=generator)
    y = amplitude * torch.sin(x - phase)
    return x[:, :points], y[:, :points], x[:, points:], y[:, points:]


def main(steps: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Linear(1, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, 1),
    )
    params = dict(net.named_parameters())

    def mse(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((functional_call(net, params, (x,)) - y) ** 2).mean()

    def task_losses(params: dict, task: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        x_support, y_support, x_query, y_query = task
        adapted = params
        for _ in range(INNER_STEPS):
            grads = grad(mse)(adapted, x_support, y_support)
            adapted = {name: p - INNER_LR * grads[name] for name, p in adapted.items()}
        return mse(adapted, x_query, y_query), mse(params, x_query, y_query)

    def losses(params: dict, tasks: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        after, before = vmap(task_losses, in_dims=(None, 0))(params, tasks)
        return after.mean(), before.mean()

    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    generator = torch.Generator().manual_seed(1)
    held_out = sample_tasks(EVAL_TASKS, SUPPORT, torch.Generator().manual_seed(12345))
    for step in range(1, steps + 1):
        loss, unadapted = losses(params, sample_tasks(TASKS, SUPPORT, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f} unadapted {unadapted.item():.4f}")
        if step % EVAL_EVERY == 0 or (step == steps and steps < EVAL_EVERY):
            with torch.no_grad():  # torch.func.grad still adapts inside
                after, before = losses(params, held_out)
            print(f"eval at step {step}: query_loss_adapted {after.item():.4f} "
                  f"query_loss_unadapted {before.item():.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="MAML on sine waves, plain PyTorch.")
    parser.add_argument("--steps", type=int, default=STEPS)
    main(parser.parse_args().steps)
