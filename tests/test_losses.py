"""Per-example quantities: ``mt.losses`` reductions against ``torch.nn.functional``, and
``mt.tree.per_example_global_norm`` against ``vmap(global_norm)`` and a loop over examples."""

import inspect

import pytest
import torch
import torch.nn.functional as F
from jaxtyping import TypeCheckError

import minitrain as mt


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(7,), (4, 3), (2, 3, 5)])
def test_mse_matches_torch(reduction, shape):
    g = torch.Generator().manual_seed(0)
    pred, target = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    got = mt.losses.mse(pred, target, reduction=reduction)
    torch.testing.assert_close(got, F.mse_loss(pred, target, reduction=reduction))
    assert got.shape == (shape if reduction == "none" else ())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("batch", [(), (3,), (3, 5)], ids=["one", "batch", "batch-seq"])
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32, torch.int16, torch.int8,
                                          torch.uint8])
def test_cross_entropy_matches_torch_per_position(reduction, dtype, batch, target_dtype):
    """Every layout (no batch dim, one, two) and every integer dtype of targets."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(*batch, 11, generator=g).to(dtype)
    targets = torch.randint(0, 11, batch, generator=g)
    got = mt.losses.cross_entropy(logits, targets.to(target_dtype), reduction=reduction)
    # F.cross_entropy's own layouts: (C), (N, C) or (N, C, d1), classes in dim 1, no reshape
    moved = logits.float().movedim(-1, 1) if len(batch) == 2 else logits.float()
    want = F.cross_entropy(moved, targets, reduction=reduction)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want)


def test_per_example_losses_give_per_example_grads():
    """The gradient of example i's ``"none"`` loss is row i of ``per_example_grads``."""
    g = torch.Generator().manual_seed(2)
    params = {"w": torch.randn(4, 3, generator=g)}
    x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    per_example = mt.per_example_grads(
        lambda p, b: mt.losses.cross_entropy(b[0] @ p["w"], b[1]))(params, (x, y))
    for i in range(6):
        row = mt.grad(lambda p, i=i: mt.losses.cross_entropy(x @ p["w"], y, "none")[i])(params)
        torch.testing.assert_close(per_example["w"][i], row["w"])


@pytest.mark.parametrize("loss", [mt.losses.mse, mt.losses.cross_entropy])
def test_unknown_reduction_is_refused(loss):
    args = (torch.zeros(2, 3), torch.zeros(2, 3)) if loss is mt.losses.mse else \
        (torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction='avg' is not one of 'mean', 'sum', 'none'"):
        loss(*args, reduction="avg")


def test_none_reduction_still_refuses_a_broadcast():
    with pytest.raises(Exception, match="batch"):
        mt.losses.mse(torch.zeros(4), torch.zeros(4, 1), reduction="none")


def _grads(batch, dtype=torch.float32, seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"layers": [{"weight": torch.randn(batch, 5, 4, generator=g).to(dtype),
                        "bias": torch.randn(batch, 5, generator=g).to(dtype)}],
            "scale": torch.randn(batch, generator=g).to(dtype), "name": "mlp"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_per_example_global_norm_is_vmapped_global_norm(dtype):
    grads = _grads(9, dtype)
    got = mt.tree.per_example_global_norm(grads)
    want = mt.vmap(mt.tree.global_norm)({k: v for k, v in grads.items() if k != "name"})
    assert got.shape == (9,) and got.dtype == (torch.float64 if dtype == torch.float64
                                               else torch.float32)
    torch.testing.assert_close(got, want)
    for i in range(9):  # and each example's global norm, one at a time
        one = mt.tree.map(lambda t, i=i: t[i] if isinstance(t, torch.Tensor) else t, grads)
        torch.testing.assert_close(got[i], mt.tree.global_norm(one))


def test_per_example_global_norm_of_an_empty_batch():
    assert mt.tree.per_example_global_norm(_grads(0)).shape == (0,)


def test_per_example_global_norm_refuses_leaves_without_the_batch_dim():
    grads = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match="leaf 'b' has shape \\(3,\\) but leaf 'w' has"):
        mt.tree.per_example_global_norm(grads)
    with pytest.raises(ValueError, match="needs tensor leaves"):
        mt.tree.per_example_global_norm({"name": "x"})


@pytest.mark.parametrize(("loss", "args", "message"), [
    (mt.losses.mse, (torch.zeros(4), torch.zeros(4, 1)),
     r"mse: pred float32\(4,\) and target float32\(4, 1\) must be floating tensors of one shape"),
    (mt.losses.mse, (torch.zeros(3), torch.zeros(3, dtype=torch.long)), r"target int64\(3,\)"),
    (mt.losses.cross_entropy, (torch.zeros(4, 3), torch.zeros(5, dtype=torch.long)),
     r"logits float32\(4, 3\) \(\*batch vocab\) and targets int64\(5,\) \(\*batch\)"),
    (mt.losses.cross_entropy, (torch.zeros(4, 3), torch.zeros(4)), r"targets float32\(4,\)"),
    (mt.losses.cross_entropy, (torch.zeros(3), torch.zeros(3, dtype=torch.long)), "without vocab"),
])
def test_a_wrong_shape_or_dtype_is_a_one_line_error(loss, args, message):
    """The loss's own check (unwrapped: the suite's import hook checks the annotations first)."""
    with pytest.raises(TypeCheckError, match=message) as error:
        inspect.unwrap(loss)(*args)
    assert "\n" not in str(error.value)
