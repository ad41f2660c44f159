"""Precision policies, their compute context and the backends built from them."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
from minitrain_backends import cpu as cpu_backends
from minitrain_backends import cuda as cuda_backends

import minitrain as mt
from minitrain.errors import UserError
from minitrain.precision import (
    POLICIES,
    Backend,
    BackendError,
    Policy,
    compute_context,
    dynamic_loss_scale,
    element_bytes,
    matmul,
    policy,
    register_backend,
    scaled_value_and_grad,
    select_tree,
)
from minitrain.precision import backend as backend_module

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_policy_casts_float_leaves_only_and_never_mutates():
    tree = {"w": torch.ones(2), "ids": torch.arange(3), "nested": [torch.zeros(1, 2)]}
    p = Policy("fp32", "fp16", "bf16")
    out = p.cast_to_compute(tree)
    assert out["w"].dtype == torch.float16 and out["ids"].dtype == torch.int64
    assert out["nested"][0].dtype == torch.float16
    assert tree["w"].dtype == torch.float32  # the input is untouched


def test_presets_keep_fp32_master_params_and_only_fp16_scales_the_loss():
    runnable = {"fp32", "bf16", "fp16", "fp8", "mxfp8", "mxfp4", "nvfp4"}
    assert set(POLICIES) == runnable | {"bf16-mixed", "bf16-pure"}
    assert all(POLICIES[n].param_dtype == torch.float32 for n in runnable)
    assert [n for n, p in POLICIES.items() if p.loss_scaling] == ["fp16"]
    assert all(name == p.name for name, p in POLICIES.items())
    with pytest.raises(ValueError, match="choose one of: fp32, bf16"):
        policy("fp12")


def test_one_vocabulary_for_backends_and_the_napkin_math():
    """bf16 is autocast over fp32 params everywhere; an unknown name lists the known ones."""
    assert element_bytes("bf16") == element_bytes(mt.get_backend("cpu-bf16").policy)
    assert tuple(element_bytes("bf16")) == (4, 4, 4, 0, 2)  # accounting's old "amp"
    assert tuple(element_bytes("bf16-pure")) == (2, 2, 2, 0, 2)  # accounting's old "bf16"
    assert tuple(element_bytes("bf16-mixed")) == (2, 2, 4, 4, 2)
    assert mt.accounting.bytes_per_param("adamw", "fp16") == mt.accounting.bytes_per_param("adamw")
    for name in ("amp", "mixed", "bfloat16", "float32"):
        with pytest.raises(UserError, match=f"unknown precision '{name}'; choose one of") as error:
            mt.accounting.bytes_per_param("adamw", name)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_compute_context_autocasts(name, dtype):
    with compute_context(name, "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
    with compute_context("fp32", torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


@pytest.mark.parametrize("name", ["fp8", "mxfp8", "nvfp4"])
def test_compute_context_simulates_the_matmul_format(name):
    a = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    b = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    with compute_context(name):
        y = a @ b
    assert torch.equal(y, matmul(a, b, name))


BACKENDS = {
    "cpu-fp16": cpu_backends.cpu_fp16,
    "cpu-fp8": cpu_backends.cpu_fp8,
    "cpu-mxfp8": cpu_backends.cpu_mxfp8,
    "cpu-mxfp4": cpu_backends.cpu_mxfp4,
    "cpu-nvfp4": cpu_backends.cpu_nvfp4,
    "cuda-fp16": cuda_backends.cuda_fp16,
    "cuda-fp8": cuda_backends.cuda_fp8,
}


@pytest.mark.parametrize("name", list(BACKENDS))
def test_backends_are_records_and_register_like_any_other(name, monkeypatch):
    # registered in this test only: other tests list the installed backends
    monkeypatch.setattr(backend_module, "_REGISTERED", dict(backend_module._REGISTERED))
    register_backend(f"test-{name}", BACKENDS[name])
    backend = BACKENDS[name]
    assert isinstance(backend, Backend) and backend.name == name
    assert backend.param_dtype == torch.float32
    if name.startswith("cpu"):
        got = mt.get_backend(f"test-{name}")
        assert got.is_available() == (True, "host CPU")
        key = "fp16" if name == "cpu-fp16" else "fp32"
        peak = mt.accounting.backend_peak_flops(got)
        assert peak == mt.accounting.hardware("cpu").peak_flops[key] > 0
        with got.autocast():
            out = torch.ones(32, 32) @ torch.ones(32, 32)
        assert out.dtype == (torch.float16 if name == "cpu-fp16" else torch.float32)
    elif not torch.cuda.is_available():
        with pytest.raises(BackendError) as error:
            mt.get_backend(f"test-{name}")
        message = str(error.value)
        assert "\n" not in message and "no CUDA GPU here" in message


def test_cuda_fp8_says_which_gpus_have_fp8(monkeypatch):
    capability = [(8, 6)]  # a pretended GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    usable, reason = cuda_backends.cuda_fp8.is_available()
    assert not usable and "compute capability >= 8.9" in reason and "8.6" in reason
    assert "\n" not in reason
    capability[0] = (9, 0)
    assert cuda_backends.cuda_fp8.is_available()[0]
    assert cuda_backends.cuda_fp8.policy.matmul_format == "fp8-scaled-mm"
    # the fp8 policy, its GEMMs on tensor cores: the same vocabulary entry as cpu-fp8's
    assert cuda_backends.cuda_fp8.policy._replace(matmul_format="fp8") == POLICIES["fp8"]


# ---------------------------------------------------------------------------------------------
# Training bytelm's model a few steps in each precision


def bytelm():
    spec = importlib.util.spec_from_file_location("bytelm_example", ROOT / "examples/bytelm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CONFIG = {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32}
# A fixed text (an old copy of examples/bytelm.py), so that no edit of the repository changes
# the data the tolerances below were measured on.
CORPUS = (ROOT / "tests/data/precision_corpus.txt").read_bytes()


def train(name: str, steps: int = 4) -> list[float]:
    """Loss per step of bytelm's model on a fixed batch of Python source bytes, AdamW on fp32
    master params. The largest gap to fp32 of each format is reached within 4 steps (as
    measured over 6)."""
    model = bytelm()
    g = torch.Generator().manual_seed(0)
    params = model.init_params(CONFIG, g)
    source = torch.frombuffer(bytearray(CORPUS), dtype=torch.uint8)
    starts = torch.randint(0, len(source) - CONFIG["seq_len"] - 1, (8,), generator=g)
    text = torch.stack([source[i : i + CONFIG["seq_len"] + 1] for i in starts.tolist()]).long()
    x, y = text[:, :-1], text[:, 1:]
    opt = mt.optim.adamw(lr=3e-3)
    opt_state = opt.init(params)
    p = policy(name)
    loss_scale = dynamic_loss_scale(init_scale=2.0**12)
    scale_state = loss_scale.init()

    def loss_fn(params, x, y):
        with compute_context(p, "cpu"):
            return mt.losses.cross_entropy(model.forward(params, x, CONFIG["n_heads"]), y)

    step = scaled_value_and_grad(loss_fn, loss_scale)
    losses = []
    for _ in range(steps):
        loss, grads, finite, scale_state = step(params, scale_state, x, y)
        new_params, new_state = opt.update(grads, opt_state, params)
        params, opt_state = select_tree(finite, (new_params, new_state), (params, opt_state))
        assert all(v.dtype == torch.float32 for v in mt.tree.leaves(params))
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def fp32_losses():
    return train("fp32")


@pytest.mark.parametrize(
    ("name", "tolerance"), [("fp16", 0.002), ("fp8", 0.01), ("mxfp8", 0.01), ("nvfp4", 0.02)]
)
def test_low_precision_training_stays_close_to_fp32(fp32_losses, name, tolerance):
    losses = train(name)
    assert losses[-1] < losses[0] - 0.1  # it learns
    for ours, reference in zip(losses, fp32_losses, strict=True):
        assert abs(ours - reference) <= tolerance * reference
    assert losses != fp32_losses  # and it did run in low precision


# ---------------------------------------------------------------------------------------------
# The resource report of a step in each precision


@pytest.mark.parametrize(("name", "dtype"), [("cpu", torch.float32), ("cpu-bf16", torch.bfloat16),
                                             ("cpu-fp16", torch.float16)])
def test_the_resource_report_measures_activations_at_the_compute_dtype(name, dtype):
    backend = mt.get_backend(name)
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(64, 256, generator=g), "w2": torch.randn(256, 64, generator=g)}
    opt = mt.optim.sgd(lr=0.1)
    batch = torch.randn(128, 64, generator=g)

    def step(params, opt_state, x):
        def loss(p):
            with backend.autocast():
                return (torch.relu(x @ p["w1"]) @ p["w2"]).float().square().mean()

        grads = torch.func.grad(loss)(params)
        return opt.update(grads, opt_state, params)

    report = mt.accounting.resource_report(
        step, params, opt.init(params), batch, peak_flops=mt.accounting.backend_peak_flops(backend),
        step_seconds=0.01
    )
    memory, speed = report["memory"], report["speed"]
    hidden = 128 * 256 * dtype.itemsize  # relu(x @ w1), saved for the backward of @ w2
    assert any(w["dtype"] == str(dtype).removeprefix("torch.") and w["bytes"] == hidden
               for w in memory["where"]), memory["where"]
    assert hidden <= memory["measured"]["activations"] < 4 * hidden
    peak = mt.accounting.hardware("cpu").peak_flops.get({"cpu": "fp32", "cpu-bf16": "bf16"}.get(
        name, "fp16"))
    assert speed["peak_flops_per_second"] == peak > 0  # the CPU probe measures fp16 too
    assert speed["mfu"] == pytest.approx(speed["achieved_flops_per_second"] / peak)
