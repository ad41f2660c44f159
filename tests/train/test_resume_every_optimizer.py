"""A run checkpointed, stopped and resumed continues bit for bit as if never stopped, for every
optimizer and wrapper of ``mt.optim``: params, every optimizer-state leaf (counts, 0-d scalars,
dtypes, devices, the NamedTuple types) and the logged loss, lr and grad-norm history. A
checkpoint of another optimizer is refused in one line, never loaded into the wrong state.

Each case trains ``STEPS`` steps uninterrupted; then trains to ``STOP`` with a checkpoint every
``EVERY`` steps and resumes to ``STEPS`` twice: from the final checkpoint (a stop) and from the
one before it with the metrics of the lost steps still on disk (a kill). 5 and 7 are multiples
of no accumulation count, warmup or patience below.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

import minitrain as mt
from minitrain import optim
from minitrain.checkpoint import CheckpointError
from minitrain.cli import main
from minitrain.optim import (
    MultiSteps,
    add_decayed_weights,
    apply_if_finite,
    as_optimizer,
    chain,
    clip_by_global_norm,
    ema,
    identity,
    inject_hyperparams,
    masked,
    multi_transform,
    reduce_on_plateau,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_muon,
    scale_by_rms,
    trace,
)

STEPS, STOP, EVERY = 12, 7, 5
LOGGED = ("step", "loss", "lr", "grad_norm", "loss_scale", "skipped")
HINT = "load with the model and optimizer the checkpoint was saved from"
NAMEDTUPLES_KEY = "minitrain.namedtuples"  # in each tensor file's safetensors metadata


# --------------------------------------------------------------------------- the model


def init(generator: torch.Generator, dtype: torch.dtype = torch.float32) -> dict:
    """Two matrices of different shapes, two vectors and a 0-d scale."""
    params = {
        "w1": torch.randn(5, 6, generator=generator) * 0.5, "b1": torch.zeros(6),
        "w2": torch.randn(6, 3, generator=generator) * 0.5,
        "b2": torch.randn(3, generator=generator) * 0.1, "t": torch.tensor(1.0),
    }
    return {name: p.to(dtype) for name, p in params.items()}


def loss(params: dict, batch: tuple) -> torch.Tensor:
    x, y = batch
    hidden = torch.tanh(x.to(params["w1"].dtype) @ params["w1"] + params["b1"])
    out = hidden @ params["w2"] * params["t"] + params["b2"]
    return ((out.float() - y) ** 2).mean()


def next_batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 5, generator=generator)
    return x, torch.sin(x[:, :3]) + 0.1 * torch.randn(8, 3, generator=generator)


def cosine(peak: float) -> optim.Schedule:
    return optim.cosine_schedule(peak, decay_steps=STEPS, warmup_steps=3)


def is_matrix(name: str, leaf: torch.Tensor) -> bool:
    return leaf.ndim == 2


def muon_label(name: str, leaf: torch.Tensor) -> str:
    return "muon" if leaf.ndim == 2 else "adamw"


# --------------------------------------------------------------------------- optimizers


def muon_and_adamw(lr: optim.ScalarOrSchedule = 0.02, hidden=None) -> optim.Optimizer:
    """examples/bytelm_muon.py's optimizer: Muon (or ``hidden``) for the matrices, Adam for
    the rest."""
    hidden = hidden or scale_by_muon(momentum=0.95)
    groups = {"muon": chain(hidden, add_decayed_weights(0.1), scale(2.0)),
              "adamw": scale_by_adam(0.9, 0.95)}
    return as_optimizer(chain(multi_transform(groups, muon_label), scale_by_learning_rate(lr)))


def spike() -> optim.GradientTransformation:
    """Infinite updates on some batches (the grad of ``b2`` sums past 0.05): data-dependent, so
    a skipped update is not repeated."""
    def update(updates, state, params=None):
        bad = updates["b2"].sum() > 0.05
        return mt.tree.map(lambda u: torch.where(bad, u * float("inf"), u), updates), state

    return optim.GradientTransformation(lambda params: optim.EmptyState(), update)


def fed_a_metric(optimizer: optim.Optimizer) -> optim.Optimizer:
    """``optimizer`` fed ``value=`` (the grads' global norm) at each update, for
    ``reduce_on_plateau``."""
    def update(grads, state, params, *, donate=False):
        value = mt.tree.global_norm(grads)
        return optimizer.update(grads, state, params, donate=donate, value=value)

    return optim.Optimizer(optimizer.init, update)


def lr_changed_at_update_4(optimizer: optim.Optimizer) -> optim.Optimizer:
    """``optimizer`` (a chain whose second state is injected) with its injected learning rate
    set to 0.003 before update 4, as a script changes it mid-run."""
    def update(grads, state, params, *, donate=False):
        injected = state[1]
        if int(injected.count) == 3:
            hyper = {**injected.hyperparams, "learning_rate": torch.tensor(0.003)}
            state = (state[0], injected._replace(hyperparams=hyper))
        return optimizer.update(grads, state, params, donate=donate)

    return optim.Optimizer(optimizer.init, update)


def adam_then(*rest: optim.GradientTransformation) -> list[optim.GradientTransformation]:
    return [scale_by_adam(), scale_by_learning_rate(0.01), *rest]


ALIASES = {
    "sgd-nesterov": lambda: optim.sgd(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam-amsgrad": lambda: optim.adam(lr=0.01, amsgrad=True, weight_decay=1e-3),
    "adamw": lambda: optim.adamw(lr=0.01, weight_decay=0.1),
    "adagrad": lambda: optim.adagrad(lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
    "rmsprop-centered-momentum": lambda: optim.rmsprop(lr=0.01, centered=True, momentum=0.9),
    "adadelta": lambda: optim.adadelta(lr=1.0, weight_decay=0.01),
    "adafactor": lambda: optim.adafactor(lr=0.01, weight_decay=0.01),
    "adamax": lambda: optim.adamax(lr=0.01, weight_decay=0.01),
    "nadam": lambda: optim.nadam(lr=0.01, weight_decay=0.01),
    "nadam-decoupled": lambda: optim.nadam(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True),
    "radam": lambda: optim.radam(lr=0.01, weight_decay=0.01),
    "radam-decoupled": lambda: optim.radam(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True),
    "muon+adamw": muon_and_adamw,
    "lion": lambda: optim.lion(lr=1e-3, weight_decay=0.1),
    "schedule-free-adamw": lambda: optim.schedule_free_adamw(lr=0.01, warmup_steps=3,
                                                             weight_decay=0.01),
}

SCHEDULED = {
    "sgd": lambda: optim.sgd(lr=cosine(0.05), momentum=0.9),
    "adam": lambda: optim.adam(lr=cosine(0.01)),
    "adamw": lambda: optim.adamw(lr=cosine(0.01)),
    "adagrad": lambda: optim.adagrad(lr=cosine(0.05)),
    "rmsprop": lambda: optim.rmsprop(lr=cosine(0.01), momentum=0.5),
    "adadelta": lambda: optim.adadelta(lr=cosine(1.0)),
    "adafactor": lambda: optim.adafactor(lr=cosine(0.01)),
    "adamax": lambda: optim.adamax(lr=cosine(0.01)),
    "nadam": lambda: optim.nadam(lr=cosine(0.01)),
    "radam": lambda: optim.radam(lr=cosine(0.01)),
    "lion": lambda: optim.lion(lr=cosine(1e-3)),
    "muon+adamw": lambda: muon_and_adamw(cosine(0.02)),
}

WRAPPERS = {
    "multisteps-3": lambda: as_optimizer(MultiSteps(chain(*adam_then()), every_k=3)),
    "multisteps-3-sgd-scheduled": lambda: as_optimizer(MultiSteps(
        chain(trace(0.9), scale_by_learning_rate(cosine(0.05))), every_k=3)),
    "apply-if-finite": lambda: as_optimizer(apply_if_finite(chain(spike(), *adam_then()))),
    "apply-if-finite-multisteps": lambda: as_optimizer(apply_if_finite(
        MultiSteps(chain(spike(), *adam_then()), every_k=3))),
    "ema": lambda: as_optimizer(chain(*adam_then(ema(0.9)))),
    "inject-hyperparams-changed": lambda: lr_changed_at_update_4(as_optimizer(chain(
        scale_by_adam(), inject_hyperparams(optim.scale_by_learning_rate)(learning_rate=0.01)))),
    "inject-hyperparams-scheduled": lambda: as_optimizer(inject_hyperparams(adamw_chain)(
        lr=cosine(0.01), weight_decay=0.1)),
    "masked": lambda: as_optimizer(chain(
        masked(scale_by_adam(), is_matrix),
        masked(trace(0.9), lambda name, leaf: leaf.ndim < 2),
        scale_by_learning_rate(0.01))),
    "multi-transform": lambda: as_optimizer(chain(multi_transform(
        {"adam": scale_by_adam(), "rms": scale_by_rms(centered=True)},
        lambda name, leaf: "adam" if name.startswith("w") else "rms"),
        scale_by_learning_rate(0.01))),
    "reduce-on-plateau": lambda: fed_a_metric(as_optimizer(chain(
        *adam_then(reduce_on_plateau(factor=0.5, patience=1))))),
    "clip-adamw-scheduled": lambda: as_optimizer(chain(
        clip_by_global_norm(0.5), scale_by_adam(b1=0.9, b2=0.95),
        add_decayed_weights(0.1, mask=is_matrix), scale_by_learning_rate(cosine(0.01)))),
    "clip-sgd-nesterov": lambda: as_optimizer(chain(
        clip_by_global_norm(0.5), trace(0.9, nesterov=True), scale_by_learning_rate(0.05))),
    "clip-lion": lambda: as_optimizer(chain(
        clip_by_global_norm(0.5), scale_by_lion(), scale_by_learning_rate(1e-3))),
    "readme-muon-stack": lambda: as_optimizer(apply_if_finite(MultiSteps(chain(
        clip_by_global_norm(1.0),
        multi_transform({"muon": chain(scale_by_muon(), add_decayed_weights(0.1), scale(0.02)),
                         "adamw": chain(scale_by_adam(0.9, 0.95), scale(3e-4))}, muon_label),
        scale_by_learning_rate(cosine(1.0)), ema(0.9)), every_k=3))),
    "no-learning-rate-in-state": lambda: as_optimizer(chain(scale_by_adam(), scale(-0.01))),
}

CASES = {
    **{f"alias-{name}": make for name, make in ALIASES.items()},
    **{f"scheduled-{name}": make for name, make in SCHEDULED.items()},
    **{f"wrapper-{name}": make for name, make in WRAPPERS.items()},
}


# --------------------------------------------------------------------------- the runs


def experiment(make, steps: int, **options) -> mt.Experiment:
    return mt.Experiment(init=init, loss=loss, next_batch=next_batch, optimizer=make(),
                         steps=steps, name="resume", **options)


def history(run: Path) -> list[dict]:
    """The logged numbers of every step (timings and memory left out)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k in LOGGED} for line in lines]


def assert_same(expected, actual, what: str) -> None:
    """Same structure (containers, keys, NamedTuple types) and, leaf for leaf, same type,
    dtype, device, shape and bits."""
    assert mt.tree.structure(actual) == mt.tree.structure(expected), what
    for (name, want), (_, got) in zip(mt.tree.named_leaves(expected), mt.tree.named_leaves(actual),
                                      strict=True):
        where = f"{what} leaf {name!r}"
        assert type(got) is type(want), where
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and got.device == want.device, where
            assert got.shape == want.shape, where
            assert torch.equal(got, want), f"{where}: {got} != {want}"
        else:
            assert got == want, where


def check_resumes_exactly(tmp_path: Path, make, backend: str = "cpu",
                          **options) -> mt.train.FitResult:
    """Train uninterrupted, then stopped at STOP and resumed (and killed after STOP and resumed
    from the checkpoint before); assert all three end alike. Returns the stopped run's result."""
    device = mt.get_backend(backend)
    quiet = dict(progress=False, say=lambda message: None)
    whole = mt.fit(experiment(make, STEPS, **options), device, out_dir=tmp_path / "whole",
                   **quiet)
    stopped = mt.fit(experiment(make, STOP, **options), device, out_dir=tmp_path / "stop",
                     checkpoint_every=EVERY, **quiet)
    shutil.copytree(tmp_path / "stop", tmp_path / "kill")
    shutil.rmtree(mt.checkpoint.checkpoint_path(tmp_path / "kill", STOP))
    for run, resumed_from in (("stop", STOP), ("kill", EVERY)):
        resumed = mt.fit(experiment(make, STEPS, **options), device, out_dir=tmp_path / run,
                         resume=True, **quiet)
        assert resumed.summary["resumed_from"] == resumed_from
        assert_same(whole.params, resumed.params, f"{run}: params")
        assert_same(whole.opt_state, resumed.opt_state, f"{run}: optimizer state")
        assert_same(whole.state, resumed.state, f"{run}: carry")
        assert history(tmp_path / run) == history(tmp_path / "whole"), run
    assert [line["step"] for line in history(tmp_path / "whole")] == list(range(1, STEPS + 1))
    return stopped


def named_state(result: mt.train.FitResult) -> dict:
    return {name: leaf for name, leaf in mt.tree.named_leaves(result.opt_state)}


# What each wrapper holds at STOP, so that the resume has something to get wrong.
MIDWAY = {
    "wrapper-multisteps-3": {"mini_step": 1, "gradient_step": 2},
    "wrapper-apply-if-finite": {"total_notfinite": 3, "inner_state.1.count": 4},
    "wrapper-apply-if-finite-multisteps": {"total_notfinite": 4, "inner_state.mini_step": 0},
    "wrapper-inject-hyperparams-changed": {"1.hyperparams.learning_rate": 0.003},
    "wrapper-reduce-on-plateau": {"2.lr": 0.25, "2.num_bad_epochs": 1},
    "wrapper-readme-muon-stack": {"inner_state.mini_step": 1, "inner_state.gradient_step": 2},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, case):
    """Every alias, every alias that takes a schedule with one, and every wrapper."""
    stopped = check_resumes_exactly(tmp_path, CASES[case])
    state = named_state(stopped)
    for name, value in MIDWAY.get(case, {}).items():
        assert float(state[name]) == pytest.approx(value), name


@pytest.mark.parametrize(("backend", "case"), [
    ("cpu-bf16", "alias-adamw"),
    ("cpu-bf16", "wrapper-multisteps-3"),
    ("cpu-fp8", "scheduled-adamw"),
    ("cpu-mxfp8", "alias-lion"),
])
def test_a_low_precision_run_resumes_exactly(tmp_path, backend, case):
    """Autocast and simulated matmul formats over fp32 master params (the fp8 amax histories
    travel in the checkpoint)."""
    check_resumes_exactly(tmp_path, CASES[case], backend)


def updates(optimizer: optim.Optimizer, params: dict, state, batches: list) -> tuple:
    """Donated updates, as the fit loop makes them; the params, state and losses after."""
    losses = []
    for batch in batches:
        value, grads = mt.value_and_grad(loss)(params, batch)
        params, state = optimizer.update(grads, state, params, donate=True)
        losses.append(value)
    return params, state, losses


@pytest.mark.parametrize(("dtype", "case"), [
    *[(torch.bfloat16, case) for case in (
        "alias-sgd-nesterov", "alias-adamw", "alias-lion", "alias-muon+adamw", "alias-adafactor",
        "alias-schedule-free-adamw", "alias-nadam", "alias-rmsprop-centered-momentum",
        "wrapper-multisteps-3", "wrapper-ema", "wrapper-clip-adamw-scheduled")],
    *[(torch.float16, case) for case in (
        "alias-sgd-nesterov", "alias-adam-amsgrad", "alias-adafactor", "alias-lion")],
    *[(torch.float64, case) for case in (
        "alias-adam-amsgrad", "alias-muon+adamw", "alias-schedule-free-adamw")],
])
def test_low_precision_params_resume_exactly_through_a_checkpoint(tmp_path, dtype, case):
    """The fit loop keeps fp32 master params; a loop of its own keeps bf16, fp16 or fp64 params
    (and their state) through mt.checkpoint.save and load into fresh templates."""
    optimizer = CASES[case]()
    generator = torch.Generator().manual_seed(3)
    batches = [next_batch(generator) for _ in range(STEPS)]
    fresh = lambda seed: init(torch.Generator().manual_seed(seed), dtype)  # noqa: E731
    whole = updates(optimizer, fresh(0), optimizer.init(fresh(0)), batches)
    params, state, before = updates(optimizer, fresh(0), optimizer.init(fresh(0)), batches[:STOP])
    path = mt.checkpoint.save(tmp_path, STOP, params, state)
    template = fresh(1)
    saved = mt.checkpoint.load(path, template, optimizer.init(template))
    resumed = updates(optimizer, saved.params, saved.opt_state, batches[STOP:])
    assert all(p.dtype == dtype and bool(p.isfinite().all()) for p in mt.tree.leaves(whole[0]))
    assert_same(whole[0], resumed[0], "params")
    assert_same(whole[1], resumed[1], "optimizer state")
    assert_same(whole[2], before + resumed[2], "losses")


def test_an_fp16_run_resumes_with_its_loss_scale_and_skipped_steps(tmp_path):
    """The scale starts too high (steps are skipped), grows every 2 finite steps and overflows
    again: at STOP both the scale and the skip count are mid-trajectory."""
    scale = mt.precision.dynamic_loss_scale(init_scale=2.0**19, growth_interval=2)
    stopped = check_resumes_exactly(tmp_path, CASES["alias-adam-amsgrad"], "cpu-fp16",
                                    loss_scale=scale)
    logged = history(tmp_path / "whole")
    assert 0 < int(stopped.state.skipped) < logged[-1]["skipped"] < STEPS
    assert len({line["loss_scale"] for line in logged}) > 2


# --------------------------------------------------------------------------- another optimizer


def adamw_chain(lr, weight_decay):
    """AdamW's chain, for ``inject_hyperparams`` (which keeps its numbers in the state)."""
    return chain(scale_by_adam(), optim.add_decayed_weights(weight_decay),
                 optim.scale_by_learning_rate(lr))


EXTRA = r"opt_state leaf '[\w.]+' is in the checkpoint but not in the template"
MISMATCHES = {  # (saved with, resumed with, a pattern of what the error names)
    "amsgrad turned on": (lambda: optim.adam(lr=0.01), ALIASES["adam-amsgrad"],
                          r"'[\d.]*max_exp_avg_sq\.w1' is not a tensor in the checkpoint"),
    "amsgrad turned off": (ALIASES["adam-amsgrad"], lambda: optim.adam(lr=0.01),
                           r"'[\d.]*max_exp_avg_sq\.\w+' is in the checkpoint but not in the "
                           r"template"),
    "momentum turned on": (lambda: optim.sgd(lr=0.05), ALIASES["sgd-nesterov"], EXTRA),
    "rmsprop centered": (lambda: optim.rmsprop(lr=0.01), ALIASES["rmsprop-centered-momentum"],
                         EXTRA),
    "nadam decoupled": (ALIASES["nadam"], ALIASES["nadam-decoupled"], EXTRA),
    "adam to adamax": (lambda: optim.adam(lr=0.01), ALIASES["adamax"], EXTRA),
    "lion to sgd": (ALIASES["lion"], ALIASES["sgd-nesterov"], EXTRA),
    "schedule-free to adamw": (ALIASES["schedule-free-adamw"], ALIASES["adamw"], EXTRA),
    "ema dropped": (WRAPPERS["ema"], lambda: as_optimizer(chain(*adam_then())), EXTRA),
    "accumulation dropped": (WRAPPERS["multisteps-3"],
                             lambda: as_optimizer(chain(*adam_then())), EXTRA),
    # The same leaf names, shapes and dtypes: only the NamedTuple types differ.
    "radam to an adam chain": (
        lambda: optim.radam(lr=0.01), lambda: as_optimizer(chain(*adam_then())),
        "opt_state node '0' is a ScaleByRadamState in the checkpoint but a ScaleByAdamState in "
        "the template"),
    "muon to sgd momentum": (
        muon_and_adamw, lambda: muon_and_adamw(hidden=chain(trace(0.95), identity())),
        r"opt_state node '0\.inner_states\.muon\.0\.0' is a MuonMomentumState in the checkpoint "
        "but a TraceState in the template"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_checkpoint_of_another_optimizer_is_refused_in_one_line(tmp_path, case):
    saved_with, resumed_with, named = MISMATCHES[case]
    cpu, run = mt.get_backend("cpu"), tmp_path / "run"
    mt.fit(experiment(saved_with, STOP), cpu, progress=False, out_dir=run)
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    with pytest.raises(CheckpointError) as error:
        mt.fit(experiment(resumed_with, STEPS), cpu, progress=False, out_dir=run, resume=True,
               say=lambda message: None)
    message = str(error.value)
    assert "\n" not in message and re.search(named, message) and message.endswith(HINT), message
    after = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    assert after.keys() - {run / ".lock"} == before.keys() - {run / ".lock"}
    assert all(after[path] == data for path, data in before.items() if path.name != ".lock")


SCRIPT = """
import torch
import minitrain as mt

CONFIG = {{"steps": {steps}}}

def experiment(config):
    def next_batch(g):
        x = torch.randn(8, 3, generator=g)
        return x, x.sum(1)
    return mt.Experiment(
        init=lambda g: {{"w": torch.randn(3, generator=g)}},
        loss=lambda p, b: ((b[0] @ p["w"] - b[1]) ** 2).mean(),
        next_batch=next_batch, optimizer={optimizer}, steps=config["steps"])
"""


def test_the_cli_refuses_a_resume_with_another_optimizer_in_one_line(tmp_path, capsys):
    """The script's optimizer changed between the run and its --resume (its CONFIG did not)."""
    script, run = tmp_path / "script.py", str(tmp_path / "run")
    script.write_text(SCRIPT.format(steps=STOP, optimizer="mt.optim.radam(lr=0.01)"))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(script), "--out", run, "--no-report"])
    assert exit_info.value.code == 0
    capsys.readouterr()
    script.write_text(SCRIPT.format(steps=STOP, optimizer=(
        "mt.optim.as_optimizer(mt.optim.chain(mt.optim.scale_by_adam(), "
        "mt.optim.scale_by_learning_rate(0.01)))")))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(script), "--out", run, "--resume", "--steps", str(STEPS), "--no-report"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "ScaleByRadamState" in err and HINT in err


def resign(path: Path, metadata: dict[str, str] | None) -> None:
    """Rewrite both tensor files of the checkpoint at ``path`` with ``metadata`` in their
    headers, and sign them (sizes, SHA-256, the state.json checksum) as a careful edit would."""
    record = json.loads((path / "state.json").read_text())
    del record["checksum"]
    for name in ("params.safetensors", "opt_state.safetensors"):
        tensors = safetensors.torch.load((path / name).read_bytes())
        data = safetensors.torch.save(tensors, metadata)
        (path / name).write_bytes(data)
        record["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    record["checksum"] = mt.checkpoint._checksum(record)
    (path / "state.json").write_text(json.dumps(record))


def saved_radam(tmp_path: Path) -> tuple[Path, dict, optim.Optimizer]:
    optimizer, params = optim.radam(lr=0.01), init(torch.Generator().manual_seed(0))
    grads = mt.tree.map(torch.ones_like, params)
    params, state = optimizer.update(grads, optimizer.init(params), params)
    return mt.checkpoint.save(tmp_path, 1, params, state), params, optimizer


def test_a_checkpoint_written_before_namedtuple_types_were_recorded_still_loads(tmp_path):
    path, params, optimizer = saved_radam(tmp_path)
    expected = mt.checkpoint.load(path, params, optimizer.init(params))
    resign(path, None)
    loaded = mt.checkpoint.load(path, params, optimizer.init(params))
    assert_same(expected.opt_state, loaded.opt_state, "optimizer state")
    assert_same(expected.params, loaded.params, "params")


@pytest.mark.parametrize("record", ["[1]", "{\"0\": 3}", "not json"])
def test_a_malformed_namedtuple_record_is_a_one_line_error(tmp_path, record):
    path, params, optimizer = saved_radam(tmp_path)
    resign(path, {NAMEDTUPLES_KEY: record})
    with pytest.raises(CheckpointError, match="not a map of paths to class names") as error:
        mt.checkpoint.load(path, params, optimizer.init(params))
    assert "\n" not in str(error.value)


def test_a_checkpoint_resumed_with_other_labels_is_refused(tmp_path):
    params = {"a": torch.ones(3, 3), "b": torch.full((3, 3), 2.0)}

    def routed(adam_leaf: str) -> optim.Optimizer:
        return as_optimizer(multi_transform(
            {"adam": chain(scale_by_adam(), scale(-0.1)),
             "sgd": chain(trace(0.9), scale(-0.1))},
            lambda name, leaf: "adam" if name == adam_leaf else "sgd"))

    saved_with = routed("a")
    state = saved_with.init(params)
    _, state = saved_with.update({"a": torch.ones(3, 3), "b": -torch.ones(3, 3)}, state, params)
    path = mt.checkpoint.save(tmp_path, 1, params, state)
    with pytest.raises(CheckpointError, match=HINT):
        mt.checkpoint.load(path, params, routed("b").init(params))
