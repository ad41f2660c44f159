"""Counter: views move nothing, and every op of a real training step has a FLOP formula.

Per-element counts of fused backward kernels are checked against the same gradient written
out in elementary ops: both must give torch's values, and the counter must count the fused
kernel exactly as many FLOPs as the elementary ops it replaces.
"""

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import minitrain as mt
from minitrain import accounting as acc
from minitrain.accounting.counter import DATA_MOVEMENT, FORMULA_OPS, POINTWISE_FLOPS
from minitrain.train import load_experiment, make_train_step
from minitrain.train.setup import run_generators, to_backend

aten = torch.ops.aten
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def count(fn, *args):
    with acc.Counter() as counter:
        out = fn(*args)
    return counter, out


def only(counter, op):
    """The one record of ``op`` (fails when there is none or several)."""
    (record,) = [r for r in counter.records if r.op == op]
    return record


# --- views ----------------------------------------------------------------------------------

VIEW_CALLS = {
    "aten._unsafe_view": lambda x: aten._unsafe_view(x, [4, 6]),
    "aten.alias": lambda x: aten.alias(x),
    "aten._reshape_alias": lambda x: aten._reshape_alias(x, [6, 4], [4, 1]),
    "aten.as_strided": lambda x: aten.as_strided(x, [2, 2], [1, 4]),
    "aten.view": lambda x: aten.view(x, [24]),
    "aten.unbind": lambda x: aten.unbind(x),
    "aten.detach": lambda x: aten.detach(x),
}


@pytest.mark.parametrize("op", sorted(VIEW_CALLS))
def test_view_like_ops_move_nothing(op):
    x = torch.randn(4, 6)
    counter, out = count(VIEW_CALLS[op], x)
    record = only(counter, op)
    assert (record.flops, record.bytes_read, record.bytes_written) == (0, 0, 0)
    assert record.has_formula and not counter.unknown
    outs = out if isinstance(out, (tuple, list)) else [out]
    assert all(o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for o in outs)


@pytest.mark.parametrize(
    "op, call",
    [
        ("aten.view_copy", lambda x: aten.view_copy(x, [24])),
        ("aten.as_strided_copy", lambda x: aten.as_strided_copy(x, [2, 2], [1, 4])),
        ("aten.clone", lambda x: aten.clone(x)),
    ],
)
def test_copies_of_views_are_charged(op, call):
    x = torch.randn(4, 6)
    record = only(count(call, x)[0], op)
    out_bytes = math.prod(record.input_shapes[0]) * 4 if op != "aten.as_strided_copy" else 16
    assert record.bytes_read == 96 and record.bytes_written == out_bytes


def test_view_copy_tag_names_a_copy_whose_twin_the_schema_marks_as_a_view():
    # torch tags X_copy ops view_copy; X itself returns Tensor(a). Both facts drive the counter.
    for copy in (
        aten.view_copy.default,
        aten.as_strided_copy.default,
        aten.t_copy.default,
        aten.unbind_copy.int,
        aten.slice_copy.Tensor,
    ):
        assert torch.Tag.view_copy in copy.tags
        twin = getattr(
            getattr(aten, copy._overloadpacket.__name__.removesuffix("_copy")), copy._overloadname
        )
        assert all(r.alias_info is not None for r in twin._schema.returns)
        assert all(r.alias_info is None for r in copy._schema.returns)


def test_reshape_of_a_non_contiguous_tensor_is_charged_one_copy():
    x = torch.randn(8, 4).t()
    counter, _ = count(lambda t: t.reshape(32), x)
    assert counter.bytes_read == counter.bytes_written == 128  # the clone; _unsafe_view is free
    assert counter.by_op["aten._unsafe_view"].calls == 1


def test_in_place_ops_alias_their_input_but_are_not_views():
    x = torch.ones(10)
    record = only(count(lambda t: t.mul_(2), x)[0], "aten.mul_")
    assert (record.flops, record.bytes_read, record.bytes_written) == (10, 40, 40)


# --- attention: torch's formulas for the CUDA kernels, applied to the CPU kernel ---------------


def torch_cuda_kernel_flops(q, k, v, grad_out):
    """FLOPs torch's flop_registry gives the CUDA flash kernels for these shapes (meta tensors,
    so no GPU is needed)."""
    meta = [torch.empty(t.shape, device="meta") for t in (q, k, v, grad_out)]
    forward = flop_registry[aten._scaled_dot_product_flash_attention](*meta[:3], out_val=None)
    backward = flop_registry[aten._scaled_dot_product_flash_attention_backward](
        meta[3], *meta[:3], out_val=None
    )
    return forward, backward


@settings(deadline=None, max_examples=12)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    q_len=st.integers(1, 9),
    kv_len=st.integers(1, 9),
    dim=st.sampled_from([4, 8, 16]),
    causal=st.booleans(),
)
def test_cpu_attention_flops_equal_torchs_formula_for_the_cuda_kernels(
    batch, heads, q_len, kv_len, dim, causal
):
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, n, dim, generator=g, requires_grad=True)
        for n in (q_len, kv_len, kv_len)
    )
    with acc.Counter() as counter, sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(torch.ones_like(out))
    forward = only(counter, "aten._scaled_dot_product_flash_attention_for_cpu")
    backward = only(counter, "aten._scaled_dot_product_flash_attention_for_cpu_backward")
    assert (forward.flops, backward.flops) == torch_cuda_kernel_flops(q, k, v, out)
    # FlashAttention (Dao et al. 2022): QKᵀ and AV, 2·2·B·H·Sq·Sk·D; the backward 2.5x that.
    assert forward.flops == 4 * batch * heads * q_len * kv_len * dim
    assert 2 * backward.flops == 5 * forward.flops
    assert not forward.is_matmul and counter.matmul_flops == 0  # FlopCounterMode skips them
    assert counter.unknown == {}


# --- fused backward kernels against the same gradient in elementary ops ------------------------


def gelu_grad_exact(g, x):
    cdf = 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2))))
    pdf = (1 / math.sqrt(2 * math.pi)) * torch.exp(-0.5 * (x * x))
    return g * (cdf + x * pdf)


def gelu_grad_tanh(g, x):
    beta, kappa = math.sqrt(2 / math.pi), 0.044715
    x2 = x * x
    t = torch.tanh(beta * (x + kappa * (x2 * x)))
    left, right = 0.5 * x, 1 + t
    left_grad, right_grad = 0.5 * right, left * (1 - t * t)
    inner_grad = beta * (1 + (3 * kappa) * x2)
    return g * (left_grad + right_grad * inner_grad)


def silu_grad(g, x):
    s = torch.reciprocal(1 + torch.exp(-x))
    return g * s * (1 + x * (1 - s))


def log_softmax_grad(g, y):
    return g - torch.exp(y) * g.sum(-1, keepdim=True)


ELEMENTWISE_BACKWARD = [
    ("gelu_backward", lambda g, x: aten.gelu_backward(g, x), gelu_grad_exact),
    ("gelu_backward", lambda g, x: aten.gelu_backward(g, x, approximate="tanh"), gelu_grad_tanh),
    ("silu_backward", aten.silu_backward, silu_grad),
    (
        "_log_softmax_backward_data",
        lambda g, y: aten._log_softmax_backward_data(g, y, -1, torch.float32),
        log_softmax_grad,
    ),
]


@pytest.mark.parametrize(
    "name, fused, elementary",
    ELEMENTWISE_BACKWARD,
    ids=["gelu", "gelu-tanh", "silu", "log-softmax"],
)
def test_fused_backward_counts_its_elementary_ops(name, fused, elementary):
    g = torch.Generator().manual_seed(1)
    grad, x = torch.randn(6, 10, generator=g), torch.randn(6, 10, generator=g)
    if name == "_log_softmax_backward_data":
        x = x.log_softmax(-1)
    fused_count, fused_out = count(fused, grad, x)
    plain_count, plain_out = count(elementary, grad, x)
    torch.testing.assert_close(fused_out, plain_out)
    assert fused_count.flops == plain_count.flops > 0
    assert fused_count.unknown == plain_count.unknown == {}


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_backward_counts_its_elementary_ops(affine):
    g = torch.Generator().manual_seed(2)
    x, grad = torch.randn(5, 12, generator=g), torch.randn(5, 12, generator=g)
    weight, bias = (
        (torch.randn(12, generator=g), torch.randn(12, generator=g)) if affine else (None, None)
    )
    _, mean, rstd = aten.native_layer_norm(x, [12], weight, bias, 1e-5)
    mask = [True, affine, affine]
    fused, (dx, dweight, dbias) = count(
        aten.native_layer_norm_backward, grad, x, [12], mean, rstd, weight, bias, mask
    )

    def elementary(grad, x):
        xhat = (x - mean) * rstd
        gw = grad * weight if affine else grad
        dx = rstd * (gw - gw.mean(-1, keepdim=True) - xhat * (gw * xhat).mean(-1, keepdim=True))
        return (dx, (grad * xhat).sum(0), grad.sum(0)) if affine else (dx,)

    plain, expected = count(elementary, grad, x)
    torch.testing.assert_close(dx, expected[0])
    if affine:
        torch.testing.assert_close((dweight, dbias), expected[1:])
    assert fused.flops == plain.flops == (13 if affine else 9) * x.numel()


def test_embedding_backward_counts_the_adds_of_index_put():
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[1, 3, 1], [0, 3, 3]])
    grad = torch.randn(2, 3, 4, generator=g)
    fused, out = count(aten.embedding_dense_backward, grad, ids, 5, -1, False)
    plain, expected = count(
        lambda: torch.zeros(5, 4).index_put_(
            (ids.reshape(-1),), grad.reshape(-1, 4), accumulate=True
        )
    )
    torch.testing.assert_close(out, expected)
    assert fused.flops == only(plain, "aten.index_put_").flops == grad.numel()
    copy = only(
        count(lambda: torch.zeros(5).index_put_((ids[0],), torch.ones(3)))[0], "aten.index_put_"
    )
    assert copy.flops == 0 and copy.has_formula  # no accumulate: a copy


def test_nll_loss_counts_one_flop_per_target():
    logits = torch.randn(6, 11, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    with acc.Counter() as counter:
        F.nll_loss(logits, target).backward()
    assert counter.by_op["aten.nll_loss_forward"].flops == 6
    assert counter.by_op["aten.nll_loss_backward"].flops == 6
    with acc.Counter() as weighted:
        F.nll_loss(logits.detach(), target, weight=torch.rand(11))
    assert weighted.by_op["aten.nll_loss_forward"].flops == 3 * 6  # multiply, add, add


def _channel(t):
    return t[None, :, None, None]


BN_GEN = torch.Generator().manual_seed(4)
BN_X = torch.randn(4, 3, 5, 6, generator=BN_GEN)
BN_W, BN_B = torch.randn(3, generator=BN_GEN), torch.randn(3, generator=BN_GEN)
BN_MEAN, BN_VAR = torch.randn(3, generator=BN_GEN), torch.rand(3, generator=BN_GEN) + 0.5
MOMENTUM, EPS = 0.1, 1e-5


def test_batch_norm_forward_counts_its_elementary_ops():
    # Training, with running statistics: torch's kernel against the same statistics written out.
    stats = (BN_MEAN.clone(), BN_VAR.clone())
    fused, (out, *_) = count(aten._native_batch_norm_legit, BN_X, BN_W, BN_B, *stats, True,
                             MOMENTUM, EPS)

    def elementary():
        mean_, var_ = BN_MEAN.clone(), BN_VAR.clone()
        var, mean = torch.var_mean(BN_X, [0, 2, 3], correction=0, keepdim=True)
        out = (BN_X - mean) * (var + EPS).rsqrt() * _channel(BN_W) + _channel(BN_B)
        n = BN_X.numel() // 3
        mean_.mul_(1 - MOMENTUM).add_(mean.flatten(), alpha=MOMENTUM)
        var_.mul_(1 - MOMENTUM).add_(var.flatten() * (n / (n - 1)), alpha=MOMENTUM)
        return out, mean_, var_

    plain, (expected, mean, var) = count(elementary)
    torch.testing.assert_close((out, *stats), (expected, mean, var))
    assert fused.flops == plain.flops == 7 * BN_X.numel() + 7 * 3
    assert fused.unknown == plain.unknown == {}
    # Eval: the running statistics normalize.
    fused, (out, *_) = count(aten._native_batch_norm_legit_no_training, BN_X, BN_W, BN_B,
                             BN_MEAN, BN_VAR, MOMENTUM, EPS)
    plain, expected = count(lambda: (BN_X - _channel(BN_MEAN)) * _channel((BN_VAR + EPS).rsqrt())
                            * _channel(BN_W) + _channel(BN_B))
    torch.testing.assert_close(out, expected)
    assert fused.flops == plain.flops == 4 * BN_X.numel() + 2 * 3
    # F.batch_norm in training mode without running statistics: no running update.
    counter, _ = count(lambda: F.batch_norm(BN_X, None, None, training=True))
    assert counter.flops == 5 * BN_X.numel() + 2 * 3 and counter.unknown == {}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batch_norm_backward_counts_its_elementary_ops(train):
    _, mean, invstd = aten._native_batch_norm_legit(
        BN_X, BN_W, BN_B, BN_MEAN.clone(), BN_VAR.clone(), True, MOMENTUM, EPS)
    grad = torch.randn(BN_X.shape, generator=torch.Generator().manual_seed(5))
    fused, grads = count(aten.native_batch_norm_backward, grad, BN_X, BN_W, BN_MEAN, BN_VAR,
                         mean, invstd, train, EPS, [True, True, True])

    def elementary():
        mu, rstd = ((_channel(mean), _channel(invstd)) if train
                    else (_channel(BN_MEAN), _channel((BN_VAR + EPS).rsqrt())))
        xhat = (BN_X - mu) * rstd
        sum_g, sum_gx = grad.sum([0, 2, 3]), (grad * xhat).sum([0, 2, 3])
        n = BN_X.numel() // 3
        if train:
            centred = grad - _channel(sum_g / n) - xhat * _channel(sum_gx / n)
            dx = centred * (_channel(BN_W) * rstd)
        else:
            dx = grad * (_channel(BN_W) * rstd)
        return dx, sum_gx, sum_g

    plain, expected = count(elementary)
    torch.testing.assert_close(grads, expected, rtol=1e-4, atol=1e-5)
    assert fused.flops == plain.flops > 0 and plain.unknown == {}
    only_dbias, _ = count(aten.native_batch_norm_backward, grad, BN_X, BN_W, BN_MEAN, BN_VAR,
                          mean, invstd, train, EPS, [False, False, True])
    assert only_dbias.flops == BN_X.numel()  # Σ g


@pytest.mark.parametrize(
    "kernel, stride, padding, dilation, ceil_mode",
    [([2], [], [0], [1], False), ([3, 2], [2, 1], [1, 0], [1, 2], True),
     ([3], [2], [0], [1], True)],
)
def test_max_pool_counts_one_comparison_per_window_element(kernel, stride, padding, dilation,
                                                            ceil_mode):
    x = torch.randn(2, 3, 9, 11, generator=torch.Generator().manual_seed(6))
    args = (kernel, stride, padding, dilation, ceil_mode)
    forward, (out, indices) = count(aten.max_pool2d_with_indices, x, *args)
    window = math.prod(kernel * 2 if len(kernel) == 1 else kernel)
    assert forward.flops == window * out.numel() and forward.unknown == {}
    # amax over the windows unfolded (no padding, no dilation): the same count
    if padding == [0] and dilation == [1] and not ceil_mode:
        k = kernel * 2 if len(kernel) == 1 else kernel
        step = stride or k
        windows = x.unfold(2, k[0], step[0]).unfold(3, k[1], step[1])
        plain, expected = count(lambda: windows.amax((-2, -1)))
        torch.testing.assert_close(out, expected)
        assert plain.flops == forward.flops
    backward, _ = count(aten.max_pool2d_with_indices_backward, torch.ones_like(out), x, *args,
                        indices)
    assert backward.flops == out.numel() and backward.unknown == {}


@pytest.mark.parametrize(
    "call, op, flops",
    [
        (lambda x: x.cumprod(0), "aten.cumprod", 24),
        (lambda x: x[1:3].sum(), "aten.slice", 0),
        (lambda x: x.logsumexp(-1), "aten.logsumexp", 4 * 24),
        (lambda x: F.leaky_relu(x), "aten.leaky_relu", 24),
        (lambda x: F.softplus(x), "aten.softplus", 5 * 24),
    ],
)
def test_table_ops(call, op, flops):
    counter, _ = count(call, torch.randn(4, 6))
    assert counter.by_op[op].flops == flops and counter.unknown == {}


def test_every_formula_table_names_a_real_aten_op():
    for name in (*POINTWISE_FLOPS, *FORMULA_OPS, *DATA_MOVEMENT):
        assert hasattr(aten, name) or hasattr(aten, name + "_"), name


# --- whole training steps: nothing left without a formula ---------------------------------------


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    from minitrain.data import prepare, source_files, stdlib_dir

    source = tmp_path_factory.mktemp("src")
    for path in source_files(stdlib_dir())[:6]:
        (source / path.name).write_bytes(path.read_bytes())
    out = tmp_path_factory.mktemp("data") / "prepared"
    prepare(out, source)
    return out


def one_step(script, overrides):
    experiment, config = load_experiment(script, overrides)
    backend = mt.get_backend("cpu")
    init_generator, data_generator = run_generators(0)
    params = to_backend(experiment.init(init_generator), backend)
    state = experiment.optimizer.init(params)
    batch = experiment.next_batch(data_generator)
    step = make_train_step(experiment, backend)
    with FlopCounterMode(display=False) as reference:
        step(params, state, batch)
    with acc.Counter() as counter:
        step(params, state, batch)
    return counter, reference, config


@pytest.mark.xfail(strict=False, reason="under the Counter the update runs its chain: "
                   "no aten._fused_adamw_ in the counted ops")
def test_bytelm_step_has_a_formula_for_every_op(small_corpus):
    small = {
        "d_model": "32",
        "n_layers": "2",
        "n_heads": "2",
        "seq_len": "16",
        "batch_size": "4",
        "data_dir": str(small_corpus),
    }
    counter, reference, config = one_step(EXAMPLES / "bytelm.py", small)
    assert counter.unknown == {}
    assert counter.matmul_flops == reference.get_total_flops() > 0
    # Attention on the CPU kernel: forward 4·B·H·S²·D per layer (H·D = d_model), backward 2.5x
    # that (10·B·H·S²·D).
    b, s, d, layers = (config[k] for k in ("batch_size", "seq_len", "d_model", "n_layers"))
    attention = sum(
        counter.by_op[f"aten._scaled_dot_product_flash_attention_for_cpu{suffix}"].flops
        for suffix in ("", "_backward")
    )
    assert attention == layers * (4 + 10) * b * s * s * d
    assert counter.by_op["aten._unsafe_view"].bytes_read == 0
    for op in (
        "aten.gelu_backward",
        "aten.native_layer_norm_backward",
        "aten.embedding_dense_backward",
        "aten.nll_loss_backward",
        "aten._fused_adamw_",
    ):
        assert counter.by_op[op].flops > 0, op


def test_linreg_step_has_a_formula_for_every_op():
    counter, reference, _ = one_step(EXAMPLES / "linreg.py", {"num_layers": "2"})
    assert counter.unknown == {}
    assert counter.matmul_flops == reference.get_total_flops() > 0


# --- optimizer updates: in-place foreach ops and fused kernels ----------------------------------


def torch_update_flops(cls, steps=2, **options):
    """Counted FLOPs of each of ``steps`` calls of a torch optimizer's ``step``, and the ledger."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(5, 3, generator=generator, requires_grad=True),
              torch.randn(7, generator=generator, requires_grad=True)]
    optimizer = cls(params, **options)
    counts, unknown = [], {}
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        with acc.Counter() as counter:
            optimizer.step()
        counts.append(counter.flops)
        unknown |= counter.unknown
    return counts, unknown


def grid(**axes):
    keys = list(axes)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*axes.values())]


FUSED_GRID = [
    *[(torch.optim.SGD, dict(lr=0.1, **o))
      for o in grid(momentum=[0.0, 0.9], weight_decay=[0.0, 0.1], maximize=[False, True],
                    nesterov=[False, True], dampening=[0.0])
      if not (o["nesterov"] and o["momentum"] == 0)],
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5)),
    *[(cls, dict(lr=0.01, **o)) for cls in (torch.optim.Adam, torch.optim.AdamW)
      for o in grid(weight_decay=[0.0, 0.1], amsgrad=[False, True], maximize=[False, True])],
    *[(torch.optim.Adagrad, dict(lr=0.1, **o))
      for o in grid(weight_decay=[0.0, 0.1], maximize=[False, True], lr_decay=[0.0, 0.01])],
]


@pytest.mark.parametrize(
    ("cls", "options"), FUSED_GRID, ids=[f"{c.__name__}-{o}" for c, o in FUSED_GRID]
)
def test_fused_update_counts_the_ops_of_torchs_single_tensor_update(cls, options):
    # Two steps: SGD's first step copies the gradient into the momentum buffer.
    fused, fused_unknown = torch_update_flops(cls, fused=True, **options)
    single, single_unknown = torch_update_flops(cls, foreach=False, fused=False, **options)
    assert fused == single and min(fused) > 0
    assert fused_unknown == single_unknown == {}


@pytest.mark.parametrize(
    "options",
    grid(momentum=[0.0, 0.9], centered=[False, True], weight_decay=[0.0, 0.1],
         maximize=[False, True]),
)
def test_rmsprop_foreach_update_counts_its_in_place_ops(options):
    foreach, foreach_unknown = torch_update_flops(torch.optim.RMSprop, foreach=True, **options)
    single, single_unknown = torch_update_flops(torch.optim.RMSprop, foreach=False, **options)
    assert foreach == single and min(foreach) > 22  # more than one FLOP per element
    assert foreach_unknown == single_unknown == {}


def test_in_place_foreach_ops_count_the_tensors_they_write():
    xs = [torch.ones(3, 4), torch.ones(5)]
    counter, _ = count(lambda: (torch._foreach_mul_(xs, 2.0), torch._foreach_addcmul_(xs, xs, xs)))
    assert counter.by_op["aten._foreach_mul_"].flops == 17
    assert counter.by_op["aten._foreach_addcmul_"].flops == 3 * 17 and counter.unknown == {}


@pytest.mark.parametrize(
    ("optimizer", "options", "per_element"),
    [("sgd", {}, 1), ("sgd", dict(momentum=0.9, first_step=True), 1),
     ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True), 6),
     ("adam", {}, 13), ("adamw", dict(weight_decay=0.1, amsgrad=True), 15),
     ("adagrad", dict(grad_scale=True), 9)],
)
def test_fused_kernel_formula(optimizer, options, per_element):
    assert acc.optimizer_flops_per_element(optimizer, **options) == per_element


def test_fused_kernel_formula_refuses_an_unknown_optimizer():
    with pytest.raises(ValueError, match="choose one of sgd, adam"):
        acc.optimizer_flops_per_element("lambda")
