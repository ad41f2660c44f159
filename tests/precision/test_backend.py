"""The backend record, its registry and the shipped backends."""

import pytest
import torch

import minitrain as mt
from minitrain.precision import Backend, BackendError, Policy, register_backend


def test_registry_lists_entry_point_backends():
    assert {"cpu", "cpu-bf16", "cuda"} <= set(mt.available_backends())


def test_auto_picks_cuda_only_when_present():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert mt.get_backend("auto").name == expected


def test_unknown_backend_lists_installed():
    with pytest.raises(BackendError, match="installed backends: cpu, cpu-bf16, cpu-fp16") as e:
        mt.get_backend("nope")
    assert str(e.value).endswith("cuda, cuda-fp16, cuda-fp8")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(BackendError, match="cannot run here: no CUDA GPU"):
        mt.get_backend("cuda")


def test_cpu_backend_is_fp32_without_autocast():
    backend = mt.get_backend("cpu")
    assert isinstance(backend, mt.Backend)
    with backend.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    batch = backend.to_device({"x": torch.ones(2)})
    assert batch["x"].device.type == "cpu"


def test_cpu_bf16_autocast_path_matches_fp32_loosely_and_keeps_fp32_grads():
    backend = mt.get_backend("cpu-bf16")
    assert backend.param_dtype == torch.float32 and backend.compute_dtype == torch.bfloat16
    params = mt.models.cruncher_init(
        dim=32, num_layers=2, generator=torch.Generator().manual_seed(0)
    )
    x, y = torch.randn(8, 32), torch.randn(8)

    def loss(p, batch):
        xb, yb = batch
        return mt.losses.mse(mt.models.cruncher(p, xb), yb)

    with backend.autocast():
        pred = mt.models.cruncher(params, x)
        value, grads = mt.value_and_grad(loss)(params, (x, y))
    assert pred.dtype == torch.bfloat16
    assert all(g.dtype == torch.float32 for g in mt.tree.leaves(grads))
    ref_value, ref_grads = mt.value_and_grad(loss)(params, (x, y))
    torch.testing.assert_close(value.float(), ref_value, rtol=5e-2, atol=5e-2)
    for g, r in zip(mt.tree.leaves(grads), mt.tree.leaves(ref_grads), strict=True):
        torch.testing.assert_close(g, r, rtol=1e-1, atol=5e-2)


def test_third_party_backend_registers(monkeypatch):
    custom = Backend("custom", "cpu", Policy("fp16", "fp16", "fp16", name="half"))
    register_backend("custom", custom)
    assert mt.get_backend("custom").param_dtype == torch.float16
    assert "custom" in mt.available_backends()
    register_backend("custom-factory", lambda: custom)  # or a function returning one
    assert mt.get_backend("custom-factory") is custom
    statuses = {s.name: s for s in mt.precision.backend_statuses()}
    assert statuses["custom"].precision == "half" and statuses["cpu-fp8"].precision == "fp8"
    monkeypatch.setitem(mt.precision.backend._REGISTERED, "bad", lambda: object())
    with pytest.raises(BackendError, match="not a minitrain.precision.Backend"):
        mt.get_backend("bad")


def test_every_shipped_backend_is_device_and_precision():
    """Backend names and precision names are one vocabulary: ``<device>-<precision>``."""
    for status in mt.precision.backend_statuses():
        if status.source.startswith("minitrain_backends."):
            device, _, precision = status.name.partition("-")
            assert precision in ("", status.precision) and device in ("cpu", "cuda")
            assert status.precision in mt.precision.POLICIES
    assert mt.get_backend("cpu").policy.name == "fp32"
    precisions = {s.name: s.precision for s in mt.precision.backend_statuses()}
    assert precisions["cpu"] == "fp32" and precisions["cuda"] == "bf16"
