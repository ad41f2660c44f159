"""predict_step: a training step predicted on fake tensors, against the same step measured."""

import dataclasses
import functools
import resource
import time

import pytest
import torch
from torch import nn

import minitrain as mt
from minitrain import accounting as acc
from minitrain.accounting.predict import PredictionError, TensorSpec, predict_step


def mlp_loss(apply):
    def loss(params, batch):
        x, y = batch
        return nn.functional.cross_entropy(apply(params, x), y)

    return loss


def mlp(dim=64, hidden=256, classes=10):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.LayerNorm(hidden),
                        nn.Linear(hidden, classes))
    params, apply = mt.from_module(net)
    return params, mlp_loss(apply)


def measured_peak(loss, params, batch, optimizer, donate=False):
    grad = mt.value_and_grad(loss)
    params = mt.tree.map(torch.clone, params)
    state = optimizer.init(params)
    with acc.Counter(keep_records=False) as counter:
        counter.track(params, state, batch)
        _, grads = grad(params, batch)
        mt.tree.global_norm(grads)
        out = optimizer.update(grads, state, params, donate=donate)
        del grads, out
    return counter


def test_specs_meta_tensors_and_real_tensors_predict_the_same_step():
    params, loss = mlp()
    batch = (torch.randn(32, 64), torch.randint(0, 10, (32,)))
    opt = mt.optim.adamw(lr=1e-3)
    real = predict_step(loss, params, batch, optimizer=opt)
    specs = predict_step(
        loss, {k: TensorSpec(tuple(v.shape)) for k, v in params.items()},
        (TensorSpec((32, 64)), ((32,), torch.int64)),
        optimizer=opt,
    )
    meta = predict_step(loss, {k: v.to("meta") for k, v in params.items()},
                        tuple(t.to("meta") for t in batch), optimizer=opt)
    for other in (specs, meta):
        assert other.peak_bytes == real.peak_bytes
        assert other.flops == real.flops and other.bytes == real.bytes
        assert other.memory["persistent"] == real.memory["persistent"]
    counter = measured_peak(loss, params, batch, opt)
    assert real.peak_bytes == pytest.approx(counter.peak_bytes, rel=0.02)
    assert real.flops == counter.flops and real.matmul_flops == counter.matmul_flops


def test_inputs_are_not_touched_and_no_real_compute_runs():
    params, loss = mlp()
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    before = mt.tree.map(torch.clone, params)
    rng = torch.get_rng_state()
    predict_step(loss, params, batch, optimizer=mt.optim.sgd(lr=0.1, momentum=0.9), donate=True)
    assert all(torch.equal(a, b) for a, b in zip(mt.tree.leaves(before), mt.tree.leaves(params),
                                                 strict=True))
    assert torch.equal(rng, torch.get_rng_state())


def test_a_billion_params_predict_in_seconds_without_their_memory():
    dim, layers, batch = 16384, 4, 64  # 1.07e9 params: 4.3 GB of fp32, 17 GB with AdamW
    params = {"layers": [{"weight": TensorSpec((dim, dim))} for _ in range(layers)],
              "final": {"weight": TensorSpec((dim, 1))}}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    pred = predict_step(lambda p, b: mt.models.cruncher(p, b[0]).square().mean(),
                        params, (TensorSpec((batch, dim)), TensorSpec((batch,))),
                        optimizer=mt.optim.adamw(lr=1e-3), hardware="h100")
    assert time.perf_counter() - start < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss < 200e6
    n = layers * dim * dim + dim
    assert pred.memory["persistent"]["params"] == 4 * n
    assert pred.memory["persistent"]["optimizer_state"] == 8 * n + 8 + 8 + 4  # moments, counts, lr
    # A pure AdamW update holds old and new params and moments, and the grads: 5 copies plus.
    assert pred.peak_phase == "update" and pred.peak_bytes > 5 * 4 * n
    assert pred.fits and pred.peak_bytes <= acc.hardware("h100").memory_bytes
    small = dataclasses.replace(acc.hardware("h100"), memory_bytes=16 * 10**9)
    assert not predict_step(lambda p, b: mt.models.cruncher(p, b[0]).square().mean(), params,
                            (TensorSpec((batch, dim)), TensorSpec((batch,))),
                            optimizer=mt.optim.adamw(lr=1e-3), hardware=small).fits


def test_the_peak_and_its_moment_are_found():
    params, loss = mlp(dim=32, hidden=64)
    opt = mt.optim.adamw(lr=1e-3)
    # Large batch: the activations dominate, so the peak is inside the backward pass.
    big = predict_step(loss, params, (TensorSpec((4096, 32)), ((4096,), torch.int64)),
                       optimizer=opt)
    assert big.peak_phase == "backward"
    assert big.memory["at_peak"]["activations"] > big.memory["persistent"]["params"]
    # Tiny batch, pure update: old and new params and moments together, in the update.
    small = predict_step(loss, params, (TensorSpec((1, 32)), ((1,), torch.int64)),
                         optimizer=opt)
    assert small.peak_phase == "update"
    donated = predict_step(loss, params, (TensorSpec((1, 32)), ((1,), torch.int64)),
                           optimizer=opt, donate=True)
    assert donated.peak_bytes <= small.peak_bytes
    for pred in (big, small, donated):
        assert sum(pred.memory["at_peak"].values()) == pred.peak_bytes


def test_saved_tensors_name_their_module():
    params, loss = mlp()
    pred = predict_step(loss, params, (TensorSpec((16, 64)), ((16,), torch.int64)),
                        optimizer=mt.optim.sgd(lr=0.1), max_grad_norm=1.0)
    assert pred.saved and pred.saved == sorted(pred.saved, key=lambda s: -s.bytes)
    modules = {saved.module for saved in pred.saved}
    assert {"Sequential.0", "Sequential.2"} & modules  # the first Linear's output, LayerNorm's
    assert sum(pred.saved_by_module.values()) == pred.memory["saved_for_backward"]
    assert pred.seconds_per_step > 0 and 0 < pred.mfu_bound <= 1


def test_a_loss_that_needs_data_is_one_line_naming_the_op():
    def loss(params, x):
        return (x @ params["w"]).sum() / (x.max().item() + 1)

    with pytest.raises(PredictionError, match="_local_scalar_dense") as info:
        predict_step(loss, {"w": torch.ones(4)}, torch.ones(2, 4))
    assert "\n" not in str(info.value)


def test_resource_report_predicts_apart_from_the_measured_step():
    params, loss = mlp()
    batch = (torch.randn(64, 64), torch.randint(0, 10, (64,)))
    opt = mt.optim.adamw(lr=1e-3)
    grad = mt.value_and_grad(loss)

    def step(params, state, batch):
        _, grads = grad(params, batch)
        mt.tree.global_norm(grads)
        return opt.update(grads, state, params)

    report = acc.resource_report(step, params, opt.init(params), batch, optimizer=opt,
                                 loss_fn=loss)
    memory = report["memory"]
    assert memory["predicted"]["source"].startswith("predict_step")
    assert memory["peak_ratio"] == pytest.approx(1.0, abs=0.10)
    assert memory["predicted"]["params"] == memory["measured"]["params"]
    assert memory["predicted"]["optimizer_state"] == memory["measured"]["optimizer_state"]
    assert memory["predicted"]["activations"] == pytest.approx(
        memory["measured"]["activations"], rel=0.10)
    assert memory["where"] and memory["where"][0]["module"].startswith("Sequential")
    assert report["flops_per_step"]["predicted"] == report["flops_per_step"]["counted"]
    text = acc.report.format_report(report)
    assert "where it goes" in text and "predicted/measured" in text


def test_autocast_bf16_is_predicted_like_the_measured_step():
    params, loss = mlp(dim=64, hidden=256)
    batch = (torch.randn(128, 64), torch.randint(0, 10, (128,)))
    opt = mt.optim.adamw(lr=1e-3)

    def bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16)

    pred = predict_step(loss, params, batch, optimizer=opt, autocast=bf16)
    grad = mt.value_and_grad(loss)
    state = opt.init(params)
    with acc.Counter(keep_records=False) as counter:
        counter.track(params, state, batch)
        with bf16():
            _, grads = grad(params, batch)
        mt.tree.global_norm(grads)
        out = opt.update(grads, state, params)
        del grads, out
    assert pred.peak_bytes == pytest.approx(counter.peak_bytes, rel=0.01)
    assert pred.flops == counter.flops
    assert pred.dtype == "bf16" and pred.saved[0].dtype == "bfloat16"


def test_model_state_is_predicted_like_the_step_that_carries_it():
    from minitrain.train import Experiment
    from minitrain.train.step import init_carry, make_train_step

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(8 * 7 * 7, 10), nn.BatchNorm1d(10))
    params, state, apply = mt.from_module(net, with_state=True)

    def loss(params, state, batch):
        x, y = batch
        logits, new_state = apply(params, state, x)
        return nn.functional.cross_entropy(logits, y), new_state

    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 10, (16,)))
    opt = mt.optim.sgd(lr=0.1, momentum=0.9)
    exp = Experiment(init=lambda g: params, init_state=lambda g: state, loss=loss,
                     next_batch=lambda g: batch, optimizer=opt, steps=1)
    backend = mt.get_backend("cpu")
    for donate in (False, True):
        pred = predict_step(loss, params, batch, optimizer=opt, donate=donate,
                            model_state=state)
        copy, carry = mt.tree.map(torch.clone, params), init_carry(exp, backend, torch.Generator())
        opt_state = opt.init(copy)
        with acc.Counter(keep_records=False) as counter:
            counter.track(copy, opt_state, batch, carry)
            out = make_train_step(exp, backend, donate=donate)(copy, opt_state, batch,
                                                               carry=carry)
            del out
        assert pred.peak_bytes == pytest.approx(counter.peak_bytes, rel=0.02)
        assert pred.flops == counter.flops and pred.unknown_ops == counter.unknown == {}
        # The statistics, and the new ones the step returns beside them (and a few scalar
        # constants the ops made on the way).
        assert pred.memory["persistent"]["buffers"] == mt.tree.nbytes(state)
        assert 0 <= pred.memory["end"]["buffers"] - 2 * mt.tree.nbytes(state) <= 64
    # The run's report: predicted on fake tensors with the state, beside the measured step.
    step = functools.partial(make_train_step(exp, backend), carry=init_carry(
        exp, backend, torch.Generator()))
    report = acc.resource_report(step, params, opt.init(params), batch, optimizer=opt,
                                 loss_fn=loss, model_state=state)
    assert report["memory"]["peak_ratio"] == pytest.approx(1.0, abs=0.02)
    assert report["flops_per_step"]["predicted"] == report["flops_per_step"]["counted"]
    with pytest.raises(ValueError, match="returns \\(value, new_state\\)"):
        predict_step(lambda p, s, b: loss(p, s, b)[0], params, batch, model_state=state)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_clipped_grads_replace_the_unclipped_ones_as_in_the_train_step(donate):
    # A tiny batch: the peak is in the clip or the update, where the grads count.
    from minitrain.train import Experiment
    from minitrain.train.step import make_train_step

    params = mt.models.cruncher_init(dim=256, num_layers=2, generator=torch.Generator())

    def loss(params, batch):
        x, y = batch
        return mt.losses.mse(mt.models.cruncher(params, x), y)

    batch = (torch.randn(2, 256), torch.randn(2))
    opt = mt.optim.sgd(lr=0.1, momentum=0.9)
    exp = Experiment(init=lambda g: params, loss=loss, next_batch=lambda g: batch, optimizer=opt,
                     steps=1, max_grad_norm=1e-9)  # every step clips
    copy = mt.tree.map(torch.clone, params)
    state = opt.init(copy)
    with acc.Counter(keep_records=False) as counter:
        counter.track(copy, state, batch)
        out = make_train_step(exp, mt.get_backend("cpu"), donate=donate)(copy, state, batch)
        del out
    pred = predict_step(loss, params, batch, optimizer=opt, donate=donate, max_grad_norm=1e-9)
    assert pred.peak_phase in ("clip", "update")
    assert pred.peak_bytes == pytest.approx(counter.peak_bytes, rel=0.01)
    assert pred.flops == counter.flops


def test_the_first_pure_update_in_a_process_counts_what_later_ones_count():
    # The recycling pool measures two use counts on its first use; made under the Counter
    # they counted one 4-byte allocation more in the first update of a process than in the
    # first update of another optimizer later (real-tensor predictions were 4 bytes above
    # meta ones when run first).
    from minitrain.optim.kernels import pool as _buffers

    _buffers._alone.cache_clear()
    params = {"w": torch.randn(16, 16), "b": torch.randn(16)}
    grads = mt.tree.map(torch.ones_like, params)
    counted = []
    for _ in range(2):  # two optimizers, each with a new pool: the same first update
        opt = mt.optim.adamw(lr=1e-3)
        state = opt.init(params)
        with acc.Counter(keep_records=False) as counter:
            out = opt.update(grads, state, params)
        counted.append((counter.bytes_written, counter.peak_bytes,
                        {name: totals.calls for name, totals in counter.by_op.items()}))
        del out
    assert counted[0] == counted[1]
