"""A lowered chain's clip scale, computed as the kernel is about to run: never from the
caller's code (a tensor-subclass max_norm, a torch mode), never dropped (non-dense params, an
update nested in a schedule), and an optimizer's count of a tensor subclass read before the
leaves are checked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import minitrain as mt
from minitrain.optim import base
from minitrain.optim.kernels import streaming

needs_kernels = pytest.mark.skipif(
    not streaming.available(), reason="no C compiler: the streaming kernels cannot be built"
)

# Frees the param's and grad's storage from the caller's code at a chosen moment of an update.
SHRINKERS = {
    "max-norm-subclass": """
victim = []
class Evil(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if victim and getattr(func, "__name__", "") in ("__rtruediv__", "__truediv__", "div"):
            for t in victim: t.untyped_storage().resize_(0)
            victim.clear()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
opt = mt.optim.as_optimizer(mt.optim.chain(
    mt.optim.clip_by_global_norm(torch.tensor(1.0).as_subclass(Evil)), mt.optim.scale_by_adam(),
    mt.optim.scale_by_learning_rate(1e-3)))
p, g = {"w": torch.randn(1 << 22)}, {"w": torch.randn(1 << 22)}
state = opt.init(p); victim += [p["w"], g["w"]]
opt.update(g, state, p, donate=DONATE)
""",
    "count-subclass": """
victim, seen = [], []
class EvilCount(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__int__", "__index__", "item"):
            seen.append(1)
            if victim and len(seen) == NTH:  # at the NTH read of the count
                for t in victim: t.untyped_storage().resize_(0)
                victim.clear()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
opt = mt.optim.adamw(lr=1e-3)
p, g = {"w": torch.randn(1 << 22)}, {"w": torch.randn(1 << 22)}
state = opt.init(p)
state = state._replace(count=state.count.as_subclass(EvilCount)); victim += [p["w"], g["w"]]
opt.update(g, state, p, donate=DONATE)
""",
}


def _run_shrinker(case: str, donate: bool, nth: int = 1) -> subprocess.CompletedProcess:
    code = "import torch, minitrain as mt\n" + SHRINKERS[case].replace(
        "DONATE", str(donate)).replace("NTH", str(nth)) + "print('intact' if victim else 'shrunk')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MINITRAIN_TYPECHECK": "0"})


def _assert_named_error(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])  # not a signal
    last = out.stderr.strip().splitlines()[-1]
    # named by the leaf's name, or by its slot in the kernel's last guard
    assert last.startswith("ValueError") and ("'w'" in last or "resized" in last), last


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("case", SHRINKERS)
def test_the_callers_code_cannot_shrink_a_storage_the_kernel_reads(case, donate):
    _assert_named_error(_run_shrinker(case, donate))


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_a_later_read_of_a_subclass_count_is_checked_too(donate):
    # An update may read the count once (then no shrink comes) or again: any later read must
    # come before the leaves are checked, so a shrink there is a named error, not a signal.
    out = _run_shrinker("count-subclass", donate, nth=2)
    if out.returncode == 0:
        assert out.stdout.strip() == "intact", out.stdout
    else:
        _assert_named_error(out)


class _CountingCount(torch.Tensor):
    """A count of a tensor subclass that counts the reads of its value (the caller's code)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__int__", "__index__", "item"):
            _CountingCount.reads += 1
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", ["auto", "fast", "plain", "compiled"])
def test_an_update_reads_a_subclass_count_once_before_its_checks(monkeypatch, impl):
    """Each read runs the caller's code; a second read, after the leaves were checked, could
    free a storage an op is about to read (it did on the plain and compiled paths)."""
    if impl == "compiled":  # the reads are the Python around the graph: skip compiling it
        monkeypatch.setattr(base.CompiledStep, "__call__", lambda self, *arguments: None)
    opt = mt.optim.adamw(lr=1e-3, impl=impl)
    params, grads = {"w": torch.randn(64)}, {"w": torch.randn(64)}
    state = opt.init(params)
    state = state._replace(count=state.count.as_subclass(_CountingCount))
    monkeypatch.setattr(_CountingCount, "reads", 0)
    opt.update(grads, state, params)
    assert _CountingCount.reads == 1


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_a_mode_the_callers_lr_enters_keeps_the_kernel_from_running(monkeypatch, donate):
    """A tensor-subclass lr is read after the one-pass check; a torch mode its code enters
    would see (and could act on) the calls made before the kernel: the update then takes
    torch's ops."""
    armed, entered = [], []

    class EnteringLr(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if armed and not entered and getattr(func, "__name__", "") == "detach":
                entered.append(_Watching())
                entered[0].__enter__()
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    calls = []
    original = streaming.prepare  # every streaming kernel is prepared here, then launched
    monkeypatch.setattr(streaming, "prepare", lambda *a, **k: calls.append(1) or original(*a, **k))
    params, grads = {"w": torch.randn(300)}, {"w": torch.randn(300)}
    want, _ = mt.optim.adamw(lr=1e-3).update(grads, mt.optim.adamw(lr=1e-3).init(params),
                                              {"w": params["w"].clone()})
    calls.clear()
    opt = mt.optim.adamw(lr=torch.tensor(1e-3).as_subclass(EnteringLr))
    state = opt.init(params)
    armed.append(1)  # from here on: inside the update, after its first checks
    try:
        got, _ = opt.update(grads, state, params, donate=donate)
    finally:
        for mode in entered:
            mode.__exit__(None, None, None)
    assert entered and entered[0].calls > 0 and not calls
    torch.testing.assert_close(got["w"], want["w"])


def _chain(lr=0.1):
    return mt.optim.chain(mt.optim.clip_by_global_norm(0.1), mt.optim.scale_by_adam(eps=1.0),
                          mt.optim.scale_by_learning_rate(lr))


def _by_the_chain(params, grads):
    tx = _chain()
    updates, _ = tx.update(grads, tx.init(params), params)
    return mt.optim.apply_updates(params, updates)


def test_non_dense_params_keep_the_clip():
    params = {"w": torch.ones(4, 8)[:, ::2]}
    grads = {"w": torch.full((4, 4), 10.0)}
    opt = mt.optim.as_optimizer(_chain())
    new, _ = opt.update(grads, opt.init(params), params)
    torch.testing.assert_close(new["w"], _by_the_chain(params, grads)["w"])


def test_an_update_inside_a_schedule_keeps_the_outer_updates_clip():
    box = {}

    def schedule(count):
        if "opt" in box and not box.get("done"):
            box["done"] = True
            inner = {"w": torch.ones(4)}
            box["opt"].update({"w": torch.ones(4)}, box["opt"].init(inner), inner)
        return 0.1

    opt = box["opt"] = mt.optim.as_optimizer(_chain(schedule))
    params, grads = {"w": torch.ones(8)}, {"w": torch.full((8,), 10.0)}
    new, _ = opt.update(grads, opt.init(params), params)
    assert box["done"]
    torch.testing.assert_close(new["w"], _by_the_chain(params, grads)["w"])


class _Watching(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@needs_kernels
def test_a_torch_function_mode_sees_torchs_ops_not_a_kernel(monkeypatch):
    """A function mode (the caller's code) would see the calls between the checks and a
    kernel: the kernels give way to torch's ops, as under a dispatch mode."""
    calls = []
    original = streaming.prepare  # every streaming kernel is prepared here, then launched
    monkeypatch.setattr(streaming, "prepare", lambda *a, **k: calls.append(1) or original(*a, **k))
    params, grads = {"w": torch.randn(300)}, {"w": torch.randn(300)}
    opt = mt.optim.as_optimizer(_chain())
    want, _ = opt.update(grads, opt.init(params), params)
    assert calls
    calls.clear()
    with _Watching() as mode:
        got, _ = opt.update(grads, opt.init(params), params)
    assert not calls and mode.calls > 0
    torch.testing.assert_close(got["w"], want["w"])
    with torch.device("cpu"):  # torch's default-device mode is not the caller's code
        assert streaming.usable([params["w"]])
