"""No garbage collection, whose finalizers are the caller's code, runs between the last check of
an update's tensors and the kernel handed their pointers: every entry point that checks, then
calls a kernel, holds collection over that window, and collection comes back afterwards."""

from __future__ import annotations

import gc

import pytest
import torch

import minitrain as mt
from minitrain.optim import _collection, base
from minitrain.optim.kernels import streaming

needs_kernels = pytest.mark.skipif(
    not streaming.available(), reason="no C compiler: the streaming kernels cannot be built"
)

_EVENTS: list[str] = []
KERNELS = ("minitrain_update", "minitrain_sumsq", "minitrain_decode_div",
           "minitrain_adafactor_stats", "minitrain_adafactor_apply")


class _Finalized:
    """Garbage in a reference cycle whose ``__del__`` stands for the caller's code (it could
    resize a storage the kernel is about to write)."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        _EVENTS.append("finalizer")


def _garbage_after(module, name: str, monkeypatch) -> None:
    """After each call of ``module.name`` (a check), leave a cycle for the next collection."""
    original = getattr(module, name)

    def checked(*args, **kwargs):
        result = original(*args, **kwargs)
        _EVENTS.append("checked")
        _Finalized()
        return result

    monkeypatch.setattr(module, name, checked)


def _record_kernels(monkeypatch) -> None:
    library = streaming._library()
    for name in KERNELS:
        original = getattr(library, name)

        def called(*args, original=original):
            _EVENTS.append("kernel")
            return original(*args)

        monkeypatch.setattr(library, name, called)


def _adamw_chain():
    return mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.clip_by_global_norm(1.0), mt.optim.scale_by_adam(),
        mt.optim.add_decayed_weights(0.1), mt.optim.scale_by_learning_rate(0.01)))


def _optimizer_update(factory, donate):
    def run():
        params = {"w": torch.randn(40, 30), "b": torch.randn(30)}
        grads = {"w": torch.randn(40, 30), "b": torch.randn(30)}
        opt = factory()
        state = opt.init(params)
        _EVENTS.clear()
        new, _ = opt.update(grads, state, params, donate=donate)
        return new["w"]
    return run


def _codes():
    codes = torch.randn(64).to(torch.float8_e4m3fn)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return streaming.decode_div(codes, table, 2.0)


def _matrix():
    return torch.rand(16, 8) + 0.5


# entry point -> (the module and name of its last check, the call)
ENTRIES = {
    "adamw pure": (base, "kernel_ready", _optimizer_update(
        lambda: mt.optim.adamw(lr=0.01, weight_decay=0.1), False)),
    "adamw donated": (base, "kernel_ready", _optimizer_update(
        lambda: mt.optim.adamw(lr=0.01, weight_decay=0.1), True)),
    "sgd with a schedule": (base, "kernel_ready", _optimizer_update(
        lambda: mt.optim.sgd(lr=mt.optim.cosine_schedule(0.1, decay_steps=10), momentum=0.9),
        False)),
    "chain with its clip": (base, "kernel_ready", _optimizer_update(_adamw_chain, False)),
    "nadam (the family)": (streaming, "_check_slots", _optimizer_update(
        lambda: mt.optim.nadam(lr=0.01), False)),
    "streaming.update": (streaming, "_check_slots", lambda: streaming.update(
        "sgd", [0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
        [[torch.ones(100)], [torch.ones(100)], None], streaming.fresh)),
    "sum_of_squares": (streaming, "_check_slots",
                       lambda: streaming.sum_of_squares([torch.ones(100)])),
    "decode_div": (streaming, "_storage_holds", _codes),
    "adafactor_stats": (streaming, "_matrix_check",
                        lambda: streaming.adafactor_stats(_matrix(), _matrix())),
    "adafactor_apply": (streaming, "_matrix_check", lambda: streaming.adafactor_apply(
        _matrix(), _matrix(), torch.ones(16, dtype=torch.float64).float(), torch.ones(8),
        [1.0, 1e-60, -1.0, 0.01, 0.0], torch.empty(16, 8))),
}


@needs_kernels
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_no_finalizer_runs_between_a_check_and_its_kernel(monkeypatch, entry):
    module, check, call = ENTRIES[entry]
    call()  # built and warm: the timed window below is the steady state
    _garbage_after(module, check, monkeypatch)
    _record_kernels(monkeypatch)
    threshold = gc.get_threshold()
    gc.collect()
    _EVENTS.clear()
    gc.set_threshold(1)  # a collection at (nearly) every allocation, where one is allowed
    try:
        result = call()
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert result is not None
    assert "checked" in _EVENTS and "kernel" in _EVENTS and "finalizer" in _EVENTS, _EVENTS
    first_check = _EVENTS.index("checked")
    last_kernel = len(_EVENTS) - 1 - _EVENTS[::-1].index("kernel")
    assert "finalizer" not in _EVENTS[first_check:last_kernel], _EVENTS
    assert gc.isenabled()


def test_holds_nest_across_threads_and_keep_a_callers_disable():
    """Collection comes back when the outermost hold ends, and stays off where the caller had
    turned it off."""
    held = _collection.COLLECTION_HELD
    with held:
        with held:
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with held:
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_collection_comes_back_after_a_failed_update():
    opt = mt.optim.adam(lr=0.1)
    params = [torch.zeros(3)]
    with pytest.raises(ValueError, match="state"):
        opt.update([torch.zeros(3)], opt.init([torch.zeros(4)]), params)
    assert gc.isenabled()
