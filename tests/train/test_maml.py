"""examples/maml_sine.py: MAML meta-training through unrolled SGD updates lowers the
post-adaptation query loss below the un-adapted one and below where it started."""

import functools
import json
from pathlib import Path

import pytest
import torch

import minitrain as mt
from minitrain.cli import main
from minitrain.train.experiment import load_experiment

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "maml_sine.py")
SMALL = {"tasks": "5", "inner_steps": "2", "inner_lr": "0.02", "lr": "0.01"}


pytestmark = pytest.mark.usefixtures("one_thread")


def query_losses(experiment, params, tasks):
    """The tasks' query loss after adaptation and before it."""
    after, aux = experiment.loss(params, tasks)
    return after, aux["unadapted"]


def test_meta_training_beats_the_unadapted_model_and_its_start(seed=0):
    experiment, config = load_experiment(SCRIPT, SMALL, steps=40)
    losses = functools.partial(query_losses, experiment)
    held_out = experiment.extras["sample_tasks"](50, config["support"],
                                                 torch.Generator().manual_seed(100 + seed))
    generator = torch.Generator().manual_seed(seed)
    params = experiment.init(generator)
    state = experiment.optimizer.init(params)
    adapted_at_start, unadapted_at_start = losses(params, held_out)
    step = mt.value_and_grad(experiment.loss, has_aux=True)
    for _ in range(experiment.steps):
        (_, aux), grads = step(params, experiment.next_batch(generator))
        params, state = experiment.optimizer.update(grads, state, params)
    adapted, unadapted = losses(params, held_out)
    assert adapted < 0.95 * unadapted, (float(adapted), float(unadapted))
    assert adapted < 0.95 * adapted_at_start, (float(adapted), float(adapted_at_start))
    assert adapted_at_start < unadapted_at_start  # even untrained, adaptation helps a little


def test_meta_gradient_flows_through_the_inner_updates():
    """The meta-gradient differs from the gradient of the query loss at the initialization
    (first-order, no adaptation): it comes through the inner SGD updates."""
    experiment, config = load_experiment(SCRIPT, {**SMALL, "inner_steps": "3"}, steps=1)
    generator = torch.Generator().manual_seed(0)
    params = experiment.init(generator)
    tasks = experiment.next_batch(generator)
    meta = mt.grad(lambda p: experiment.loss(p, tasks)[0])(params)
    plain = mt.grad(lambda p: experiment.loss(p, tasks)[1]["unadapted"])(params)
    assert all(torch.isfinite(g).all() for g in meta.values())
    difference = sum(float((meta[k] - plain[k]).norm()) for k in meta)
    assert difference > 1e-3


def test_runs_under_minitrain_run(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", SCRIPT, "--steps", "4", "--set", "tasks=3", "--set", "eval_tasks=5",
              "--json"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    summary = json.loads(out)
    assert summary["steps"] == 4
    assert set(summary["eval"]) == {"query_loss_adapted", "query_loss_unadapted"}
