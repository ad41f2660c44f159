"""apply_updates names a leaf that is no tensor in one line, before its structure check could
blame a shape (a None update used to read "shape (2,) vs ()")."""

import pytest
import torch

from minitrain.optim import apply_updates


@pytest.mark.parametrize(("params", "updates", "message"), [
    ({"a": torch.ones(())}, {"a": 2.0},
     "apply_updates: updates leaf 'a' is of type float, not a tensor; pass torch.tensor(2.0)"),
    ({"a": 1.0}, {"a": torch.ones(())},
     "apply_updates: param 'a' is of type float, not a tensor; pass torch.tensor(1.0)"),
    ({"a": torch.ones(2)}, {"a": None}, "the grad of 'a' is None"),
    ({"a": None}, {"a": torch.ones(2)}, "'a' is None"),
])
def test_a_leaf_that_is_no_tensor_is_named_in_one_line(params, updates, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        apply_updates(params, updates)
    assert "\n" not in str(error.value)
    assert "shape" not in str(error.value)


def test_tensor_leaves_still_add_in_the_params_dtype():
    params = {"w": torch.ones(2, dtype=torch.bfloat16), "i": torch.tensor([3])}
    out = apply_updates(params, {"w": torch.full((2,), 0.5), "i": torch.tensor([1.7])})
    assert out["w"].dtype == torch.bfloat16 and out["w"].tolist() == [1.5, 1.5]
    # (3 + 1.7) cast to int64 as torch casts
    assert out["i"].dtype == torch.int64 and out["i"].tolist() == [4]
