"""A hostile caller's inputs to the optimizers: hyperparameters whose conversion runs the
caller's code (which shrinks a storage a kernel is about to use), grads and state that alias
another leaf's param under donation, complex params for the family, and hand-edited counts and
schedules. Each is a clear ``ValueError`` or the pure update's result, never a read or write
out of bounds."""

from __future__ import annotations

import pytest
import torch

import minitrain as mt
from minitrain.optim.kernels import streaming

needs_kernels = pytest.mark.skipif(
    not streaming.available(), reason="no C compiler: the streaming kernels cannot be built"
)

N = 1 << 16


class _Shrinking(float):
    """A float hyperparameter whose ``__float__``, once armed, frees a param's storage."""

    victim: torch.Tensor | None = None

    def __float__(self):
        victim, type(self).victim = type(self).victim, None
        if victim is not None:
            victim.untyped_storage().resize_(0)
        return super().__float__()


class _LateProduct(float):
    """``lr`` whose product with the weight decay is a :class:`_Shrinking` (Adafactor)."""

    def __mul__(self, other):
        return _Shrinking(float(self) * other)


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
@pytest.mark.parametrize("factory,grad", [
    (lambda wd: mt.optim.adamw(lr=1e-3, weight_decay=wd), lambda: torch.ones(1).expand(N)),
    (lambda wd: mt.optim.adamw(lr=1e-3, weight_decay=wd), lambda: torch.ones(N)),
    (lambda wd: mt.optim.nadam(lr=1e-3, weight_decay=wd), lambda: torch.ones(N)),
], ids=["adamw-expanded-grad", "adamw", "nadam"])
def test_a_float_subclass_that_shrinks_a_param_is_read_before_the_checks(factory, grad, donate):
    params = {"w": torch.ones(N)}
    opt = factory(_Shrinking(0.1))
    state = opt.init(params)
    _Shrinking.victim = params["w"]
    try:
        with pytest.raises(ValueError, match="resized"):
            opt.update({"w": grad()}, state, params, donate=donate)
    finally:
        _Shrinking.victim = None


class _Beta(torch.Tensor):
    """A tensor-subclass beta whose torch function, once armed, frees a param's storage."""

    victim: torch.Tensor | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        victim, _Beta.victim = _Beta.victim, None
        if victim is not None:
            victim.untyped_storage().resize_(0)
        return super().__torch_function__(func, types, args, kwargs or {})


@needs_kernels
@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_tensor_subclass_betas_run_before_the_one_pass_check(donate):
    params = {"w": torch.ones(N)}
    betas = (torch.tensor(0.9).as_subclass(_Beta), torch.tensor(0.999).as_subclass(_Beta))
    opt = mt.optim.adamw(lr=1e-3, betas=betas)
    state = opt.init(params)
    _Beta.victim = params["w"]
    try:
        with pytest.raises(ValueError, match="resized"):
            opt.update({"w": torch.ones(N)}, state, params, donate=donate)
    finally:
        _Beta.victim = None


@needs_kernels
def test_adafactor_takes_its_hyperparameters_before_its_checks():
    params = {"w": torch.ones(256, 256)}
    opt = mt.optim.adafactor(lr=_LateProduct(1e-2), weight_decay=0.1)
    state = opt.init(params)
    _Shrinking.victim = params["w"]
    try:
        with pytest.raises(ValueError, match="resized"):
            opt.update({"w": torch.full((256, 256), 0.5)}, state, params)
    finally:
        _Shrinking.victim = None
    g, p = torch.ones(8, 4), torch.ones(8, 4)
    rows, cols, _ = streaming.adafactor_stats(g, p)
    _Shrinking.victim = p
    with pytest.raises(ValueError, match="resized"):
        streaming.adafactor_apply(g, p, rows.float(), cols.float(),
                                  [1.0, 1e-60, -1.0, _Shrinking(0.01), 0.0])


@needs_kernels
def test_decode_div_refuses_a_table_it_cannot_read_and_reads_the_scale_first():
    codes = torch.randn(64).to(torch.float8_e4m3fn)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    torch.testing.assert_close(streaming.decode_div(codes, table, 2.0), codes.float() / 2.0)
    shrunk = table.clone()
    shrunk.untyped_storage().resize_(0)
    assert streaming.decode_div(codes, shrunk, 2.0) is None
    assert streaming.decode_div(codes, table.to("meta"), 2.0) is None
    _Shrinking.victim = codes
    assert streaming.decode_div(codes, table, _Shrinking(2.0)) is None  # codes then shrunk


def _sgd_with_momentum():
    return mt.optim.sgd(lr=0.5, momentum=0.9)


def _chain():
    return mt.optim.as_optimizer(mt.optim.chain(
        mt.optim.clip_by_global_norm(1.0), mt.optim.scale_by_adam(),
        mt.optim.add_decayed_weights(0.1), mt.optim.scale_by_learning_rate(0.01)))


def _identity_chain():  # no lowering: the generic path adds its updates (the grads) in place
    return mt.optim.as_optimizer(mt.optim.chain())


@pytest.mark.parametrize("factory", [
    _sgd_with_momentum, lambda: mt.optim.adamw(lr=0.1), lambda: mt.optim.nadam(lr=0.1),
    _chain, _identity_chain], ids=["sgd", "adamw", "nadam", "chain", "generic-chain"])
def test_donating_grads_that_are_other_leaves_params_gives_the_pure_result(factory):
    def run(donate):
        torch.manual_seed(0)
        x, y = torch.randn(1000), torch.randn(1000)
        params = {"a": x, "b": y}
        opt = factory()
        new, _ = opt.update({"a": y, "b": x}, opt.init(params), params, donate=donate)
        return new

    pure, donated = run(False), run(True)
    for key in pure:
        torch.testing.assert_close(donated[key], pure[key], rtol=0, atol=0)


def test_donating_a_state_leaf_that_is_its_param_gives_the_pure_result():
    def run(donate):
        torch.manual_seed(1)
        x = torch.randn(1000)
        opt = _sgd_with_momentum()
        state = opt.update({"a": torch.randn(1000)}, opt.init({"a": x}), {"a": x.clone()})[1]
        state = state._replace(momentum_buffer={"a": x})  # edited by hand: the param itself
        return opt.update({"a": torch.ones(1000)}, state, {"a": x}, donate=donate)[0]["a"]

    torch.testing.assert_close(run(True), run(False), rtol=0, atol=0)


def test_donating_a_muon_momentum_that_is_its_param_gives_the_pure_result():
    def run(donate):
        torch.manual_seed(2)
        params = {"a": torch.randn(16, 8), "b": torch.randn(8, 16)}
        opt = mt.optim.muon(lr=0.1)
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        params, state = opt.update(grads, opt.init(params), params)
        (momentum, ortho), decay, lr = state
        momentum = momentum._replace(momentum_buffer={  # edited by hand: "a"'s is its param
            "a": params["a"], "b": momentum.momentum_buffer["b"]})
        return opt.update(grads, ((momentum, ortho), decay, lr), params, donate=donate)[0]

    pure, donated = run(False), run(True)
    for key in pure:
        torch.testing.assert_close(donated[key], pure[key], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["nadam", "radam", "adamax", "adadelta", "asgd", "rprop"])
def test_the_family_refuses_complex_params_naming_them(name):
    opt = getattr(mt.optim, name)(lr=0.1)
    params = {"w": torch.randn(4, 3, dtype=torch.complex64)}
    with pytest.raises(ValueError, match="param 'w' is torch.complex64"):
        opt.init(params)
    real = opt.init({"w": torch.randn(4, 3)})
    with pytest.raises(ValueError, match="param 'w' is torch.complex64"):
        opt.update({"w": torch.randn(4, 3, dtype=torch.complex64)}, real, params)


@pytest.mark.parametrize("factory", [
    lambda schedule: mt.optim.adamw(lr=schedule),
    lambda schedule: mt.optim.adafactor(lr=schedule)], ids=["adamw", "adafactor"])
@pytest.mark.parametrize("value", [torch.tensor([0.1, 0.2]), None], ids=["two-elements", "None"])
def test_a_schedules_bad_value_names_the_schedule(factory, value):
    def schedule(step):
        return value if step > 0 else 0.1

    opt = factory(schedule)
    params = {"w": torch.ones(4, 3)}
    state = opt.init(params)
    params, state = opt.update({"w": torch.ones(4, 3)}, state, params)
    with pytest.raises(ValueError, match=r"lr \(from the schedule\)"):
        opt.update({"w": torch.ones(4, 3)}, state, params)


@pytest.mark.parametrize("count,words", [
    (3, "not a one-element tensor"),
    (torch.zeros((), dtype=torch.int64, device="meta"), "not a one-element tensor"),
    (torch.tensor([1, 2]), "not a one-element tensor"),
    (torch.tensor(-5), "a count of updates is >= 0"),
], ids=["int", "meta", "two-elements", "negative"])
@pytest.mark.parametrize("name", [
    "adam", "nadam", "radam", "adamax", "adadelta", "asgd", "rprop", "adafactor", "muon", "lion",
    "schedule_free_adamw", "scheduled-chain", "ema-chain", "injected"])
def test_a_hand_edited_count_is_a_value_error_naming_it(name, count, words):
    opt = _counted_optimizer(name)
    params = {"w": torch.ones(4, 3)}
    state = _with_counts(opt.init(params), count)
    with pytest.raises(ValueError, match=f"state.count is .*{words}"):
        opt.update({"w": torch.ones(4, 3)}, state, params)


def _counted_optimizer(name):
    tx = mt.optim
    if name == "scheduled-chain":
        return tx.as_optimizer(tx.chain(tx.scale_by_adam(), tx.scale_by_learning_rate(
            tx.cosine_schedule(0.1, decay_steps=10))))
    if name == "ema-chain":
        return tx.as_optimizer(tx.chain(tx.scale_by_learning_rate(0.1), tx.ema(0.9)))
    if name == "injected":
        return tx.as_optimizer(tx.inject_hyperparams(tx.scale_by_learning_rate)(
            learning_rate=tx.cosine_schedule(0.1, decay_steps=10)))
    return getattr(tx, name)(lr=0.1)


def _with_counts(state, count):
    """``state`` with every ``count`` field, at any depth, replaced by ``count``."""
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        fields = {f: _with_counts(getattr(state, f), count) for f in state._fields}
        if "count" in fields:
            fields["count"] = count
        return type(state)(**fields)
    if isinstance(state, tuple):
        return type(state)(_with_counts(s, count) for s in state)
    return state


@pytest.mark.parametrize("name", [
    "sgd", "adamw", "adagrad", "rmsprop", "nadam", "rprop", "lion", "adafactor", "muon",
    "clip-chain"])
@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # torch's, on making one
def test_a_sparse_grad_is_a_value_error_naming_its_leaf(name, layout):
    tx = mt.optim
    opt = tx.as_optimizer(tx.chain(tx.clip_by_global_norm(1.0), tx.scale_by_adam(),
                                   tx.scale_by_learning_rate(0.1))) \
        if name == "clip-chain" else getattr(tx, name)(lr=0.1)
    params = {"emb": torch.ones(4, 3)}
    dense = torch.zeros(4, 3)
    dense[1] = 1.0  # an embedding's grad: the rows looked up
    grad = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    with pytest.raises(ValueError, match="grad of 'emb' is a torch.sparse_.* dense grads"):
        opt.update({"emb": grad}, opt.init(params), params)


@pytest.mark.parametrize("name", ["nadam", "adadelta", "lion"])
def test_the_family_names_a_grad_of_another_dtype(name):
    opt = getattr(mt.optim, name)(lr=0.1)
    params = {"w": torch.ones(4, 3)}
    with pytest.raises(ValueError, match="grads differ from params at leaf 'w'"):
        opt.update({"w": torch.ones(4, 3, dtype=torch.float64)}, opt.init(params), params)
