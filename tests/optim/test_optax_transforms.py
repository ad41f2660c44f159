"""optax's transformations torch.optim lacks, each against a plain loop written here from optax's
source formula (``_src/transform.py``, ``alias.py``, ``lookahead.py``, ``contrib/_privacy.py``,
``schedules/_schedule.py``): 50 updates in float64 on a tree of a scalar, a vector and a 3-D
leaf, rtol 1e-10. Below them the generic checks of ``test_alias.py`` that need no torch.optim
reference run over the aliases of ``OPTAX_ONLY``."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from jaxtyping import TypeCheckError

import minitrain as mt
from tests.optim import test_alias as generic
from tests.optim.conftest import OPTAX_ONLY

F64 = torch.float64
STEPS = 50
CLOSE = dict(rtol=1e-10, atol=1e-12)
optim = mt.optim


def tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"s": torch.randn((), generator=g, dtype=F64),
            "v": torch.randn(5, generator=g, dtype=F64),
            "t": torch.randn(2, 3, 4, generator=g, dtype=F64)}


def grads(seed: int = 1, steps: int = STEPS) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [mt.tree.map(lambda p: torch.randn(p.shape, generator=g, dtype=F64), tree())
            for _ in range(steps)]


def run_optimizer(opt, params, grads_seq, **extra):
    """The params after each update."""
    state, after = opt.init(params), []
    for g in grads_seq:
        params, state = opt.update(g, state, params, **extra)
        after.append(params)
    return after


def run_leaves(step_leaf, params, grads_seq, init):
    """A per-leaf reference: ``step_leaf(t, g, p, buffers) -> new p`` with buffers from
    ``init(p)``, the params after each update."""
    buffers = {k: init(p) for k, p in params.items()}
    after = []
    for t, g in enumerate(grads_seq, start=1):
        params = {k: step_leaf(t, g[k], p, buffers[k]) for k, p in params.items()}
        after.append(params)
    return after


def assert_runs_close(ours, reference):
    assert len(ours) == len(reference) == STEPS
    for step, (a, b) in enumerate(zip(ours, reference, strict=True)):
        for k in b:
            torch.testing.assert_close(a[k], b[k], **CLOSE, msg=lambda m, step=step, k=k:
                                       f"update {step + 1}, leaf {k}: {m}")


def zeros(*names):
    return lambda p: {n: torch.zeros_like(p) for n in names}


# -- Adam's eps_root, RMSprop's bias correction, Adafactor's momentum --------------------------


def test_scale_by_adam_eps_root_matches_optax():
    b1, b2, eps, eps_root, lr = 0.9, 0.99, 1e-8, 1e-3, 0.01

    def step(t, g, p, s):  # optax scale_by_adam: m_hat / (sqrt(v_hat + eps_root) + eps)
        s["m"] = (1 - b1) * g + b1 * s["m"]
        s["v"] = (1 - b2) * g * g + b2 * s["v"]
        m_hat, v_hat = s["m"] / (1 - b1**t), s["v"] / (1 - b2**t)
        return p - lr * m_hat / (torch.sqrt(v_hat + eps_root) + eps)

    opt = optim.as_optimizer(optim.chain(optim.scale_by_adam(b1, b2, eps, eps_root=eps_root),
                                         optim.scale_by_learning_rate(lr)))
    assert_runs_close(run_optimizer(opt, tree(), grads()),
                      run_leaves(step, tree(), grads(), zeros("m", "v")))


@pytest.mark.parametrize("centered", [False, True])
def test_scale_by_rms_bias_correction_matches_optax(centered):
    decay, eps, lr = 0.9, 1e-8, 0.01

    def step(t, g, p, s):  # optax scale_by_rms / scale_by_stddev, eps_in_sqrt=False
        s["nu"] = (1 - decay) * g * g + decay * s["nu"]
        s["mu"] = (1 - decay) * g + decay * s["mu"]
        nu_hat, mu_hat = s["nu"] / (1 - decay**t), s["mu"] / (1 - decay**t)
        variance = nu_hat - mu_hat**2 if centered else nu_hat
        return p - lr * g / (torch.sqrt(variance) + eps)

    # A zero first grad: at t = 1 the centered variance g² - g² is 0, so rounding picks NaN
    grads_seq = [mt.tree.map(torch.zeros_like, tree()), *grads(steps=STEPS - 1)]
    opt = optim.as_optimizer(optim.chain(
        optim.scale_by_rms(decay, eps, centered=centered, bias_correction=True),
        optim.scale_by_learning_rate(lr)))
    assert_runs_close(run_optimizer(opt, tree(), grads_seq),
                      run_leaves(step, tree(), grads_seq, zeros("nu", "mu")))


def test_adafactor_then_ema_updates_is_optax_adafactors_momentum():
    lr, decay, eps1, eps2, d, momentum = 0.05, -0.8, 1e-30, 1e-3, 1.0, 0.9

    def step(t, g, p, s):  # torch's Adafactor; optax's ema(momentum, debias=False) of the step
        beta = t**decay
        if g.dim() > 1:
            s["r"] = (1 - beta) * s["r"] + beta * (g * g).mean(-1, keepdim=True)
            s["c"] = (1 - beta) * s["c"] + beta * (g * g).mean(-2, keepdim=True)
            v = s["r"] @ s["c"] / s["r"].mean(-2, keepdim=True).clamp(min=eps1)
        else:
            s["v"] = (1 - beta) * s["v"] + beta * g * g
            v = s["v"]
        u = g / v.clamp(min=eps1 * eps1).sqrt()
        u = u / max(1.0, float(u.pow(2).mean().sqrt()) / d)
        alpha = max(eps2, float(p.pow(2).mean().sqrt())) * min(lr, 1 / math.sqrt(t))
        s["m"] = (1 - momentum) * alpha * u + momentum * s["m"]
        return p - s["m"]

    def init(p):
        shape = p.shape
        return {"r": torch.zeros(*shape[:-1], 1, dtype=F64) if p.dim() > 1 else None,
                "c": torch.zeros(*shape[:-2], 1, shape[-1], dtype=F64) if p.dim() > 1 else None,
                "v": torch.zeros_like(p), "m": torch.zeros_like(p)}

    opt = optim.as_optimizer(optim.chain(
        optim.scale_by_adafactor(lr=lr, beta2_decay=decay, eps=(eps1, eps2), d=d),
        optim.ema_updates(momentum, debias=False)))
    assert_runs_close(run_optimizer(opt, tree(), grads()), run_leaves(step, tree(), grads(), init))


# -- AdaBelief, Yogi, LAMB, LARS, Polyak SGD, the EMA of updates -------------------------------


@pytest.mark.parametrize("nesterov", [False, True])
def test_adabelief_matches_optax(nesterov):
    b1, b2, eps, eps_root, lr, wd = 0.9, 0.999, 1e-16, 1e-16, 0.01, 0.1

    def step(t, g, p, s):  # optax scale_by_belief, then decoupled decay and -lr
        s["mu"] = (1 - b1) * g + b1 * s["mu"]
        s["nu"] = (1 - b2) * (g - s["mu"]) ** 2 + b2 * s["nu"] + eps_root
        if nesterov:
            m_hat = b1 * s["mu"] / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        else:
            m_hat = s["mu"] / (1 - b1**t)
        u = m_hat / (torch.sqrt(s["nu"] / (1 - b2**t)) + eps)
        return p - lr * (u + wd * p)

    opt = optim.adabelief(lr, b1, b2, eps, eps_root, weight_decay=wd, nesterov=nesterov)
    assert_runs_close(run_optimizer(opt, tree(), grads()),
                      run_leaves(step, tree(), grads(), zeros("mu", "nu")))


def test_yogi_matches_optax():
    b1, b2, eps, lr, initial = 0.9, 0.999, 1e-3, 0.01, 1e-6

    def step(t, g, p, s):  # optax scale_by_yogi
        s["mu"] = (1 - b1) * g + b1 * s["mu"]
        s["nu"] = s["nu"] - (1 - b2) * torch.sign(s["nu"] - g * g) * g * g
        return p - lr * (s["mu"] / (1 - b1**t)) / (torch.sqrt(s["nu"] / (1 - b2**t)) + eps)

    assert_runs_close(run_optimizer(optim.yogi(lr, b1, b2, eps), tree(), grads()),
                      run_leaves(step, tree(), grads(), lambda p: {
                          "mu": torch.full_like(p, initial), "nu": torch.full_like(p, initial)}))


def trust_ratio(u, p, coefficient=1.0, eps=0.0):
    """optax scale_by_trust_ratio with min_norm 0."""
    p_norm, u_norm = float(p.norm()), float(u.norm())
    return 1.0 if p_norm == 0 or u_norm == 0 else coefficient * p_norm / (u_norm + eps)


def test_lamb_matches_optax():
    b1, b2, eps, lr, wd = 0.9, 0.999, 1e-6, 0.01, 0.1

    def step(t, g, p, s):  # scale_by_adam, add_decayed_weights, scale_by_trust_ratio, -lr
        s["m"] = (1 - b1) * g + b1 * s["m"]
        s["v"] = (1 - b2) * g * g + b2 * s["v"]
        u = (s["m"] / (1 - b1**t)) / (torch.sqrt(s["v"] / (1 - b2**t)) + eps) + wd * p
        return p - lr * trust_ratio(u, p) * u

    assert_runs_close(run_optimizer(optim.lamb(lr, b1, b2, eps, weight_decay=wd), tree(), grads()),
                      run_leaves(step, tree(), grads(), zeros("m", "v")))


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_matches_optax(nesterov):
    lr, wd, coefficient, momentum = 0.5, 0.01, 0.001, 0.9
    mask = {"s": False, "v": True, "t": True}

    def step(t, g, p, s):  # decay, trust ratio (masked), -lr, optax's trace
        u = g + wd * p
        if s["masked_in"]:
            u = u * trust_ratio(u, p, coefficient)
        u = -lr * u
        s["trace"] = u + momentum * s["trace"]
        return p + (u + momentum * s["trace"] if nesterov else s["trace"])

    params = tree()
    flags = iter(mask.values())
    reference = run_leaves(step, params, grads(), lambda p: {"trace": torch.zeros_like(p),
                                                             "masked_in": next(flags)})
    opt = optim.lars(lr, wd, trust_coefficient=coefficient, trust_ratio_mask=mask,
                     momentum=momentum, nesterov=nesterov)
    assert_runs_close(run_optimizer(opt, params, grads()), reference)


@pytest.mark.parametrize("variant", ["sps", "sps+"])
def test_polyak_sgd_matches_optax(variant):
    max_lr, scaling, f_min = 0.3, 0.5, 1.0
    params, grads_seq = tree(), grads()
    losses = [float(v) for v in torch.linspace(3.0, -1.0, STEPS, dtype=F64)]
    reference, p = [], params
    for g, loss in zip(grads_seq, losses, strict=True):  # sgd(scaling), then scale_by_polyak
        u = {k: -scaling * x for k, x in g.items()}
        squared = sum(float((x * x).sum()) for x in u.values())
        gap = max(loss - f_min, 0.0) if variant == "sps+" else loss - f_min
        size = 0.0 if squared <= torch.finfo(F64).eps else min(gap / squared, max_lr)
        p = {k: p[k] + size * u[k] for k in p}
        reference.append(p)
    opt = optim.polyak_sgd(max_lr, scaling, f_min, variant=variant)
    state, ours = opt.init(params), []
    for g, loss in zip(grads_seq, losses, strict=True):
        params, state = opt.update(g, state, params, value=torch.tensor(loss, dtype=F64))
        ours.append(params)
    assert_runs_close(ours, reference)
    with pytest.raises(ValueError, match="value=loss"):
        opt.update(grads_seq[0], state, params)


@pytest.mark.parametrize("debias", [True, False])
def test_ema_updates_matches_optax_ema(debias):
    decay, lr = 0.8, 0.1

    def step(t, g, p, s):
        s["ema"] = (1 - decay) * g + decay * s["ema"]
        return p - lr * (s["ema"] / (1 - decay**t) if debias else s["ema"])

    opt = optim.as_optimizer(optim.chain(optim.ema_updates(decay, debias),
                                         optim.scale_by_learning_rate(lr)))
    assert_runs_close(run_optimizer(opt, tree(), grads()),
                      run_leaves(step, tree(), grads(), zeros("ema")))


# -- lookahead, DP aggregation ------------------------------------------------------------------


@pytest.mark.parametrize("reset_state", [False, True])
def test_lookahead_matches_optax(reset_state):
    period, alpha, lr, momentum = 5, 0.5, 0.05, 0.9
    params, grads_seq = tree(), grads()
    fast, slow = dict(params), dict(params)
    buffers = {k: torch.zeros_like(p) for k, p in params.items()}
    reference = []
    for t, g in enumerate(grads_seq, start=1):  # grads taken at fast; SGD with momentum
        for k in fast:
            buffers[k] = momentum * buffers[k] + g[k]
            fast[k] = fast[k] - lr * buffers[k]
        if t % period == 0:  # sync: slow moves alpha of the way, fast jumps there
            slow = {k: slow[k] + alpha * (fast[k] - slow[k]) for k in slow}
            fast = dict(slow)
            if reset_state:
                buffers = {k: torch.zeros_like(b) for k, b in buffers.items()}
        reference.append(optim.LookaheadParams(dict(fast), dict(slow)))
    opt = optim.as_optimizer(optim.lookahead(optim.chain(
        optim.trace(momentum), optim.scale_by_learning_rate(lr)), period, alpha, reset_state))
    ours = run_optimizer(opt, optim.LookaheadParams.init_synced(params), grads_seq)
    for a, b in zip(ours, reference, strict=True):
        for half in ("fast", "slow"):
            for k in params:
                torch.testing.assert_close(getattr(a, half)[k], getattr(b, half)[k], **CLOSE)


def test_differentially_private_aggregate_matches_optax():
    clip, multiplier, batch = 1.5, 0.7, 8
    params = tree()
    g = torch.Generator().manual_seed(3)
    per_example = [mt.tree.map(lambda p: torch.randn(batch, *p.shape, generator=g, dtype=F64),
                               params) for _ in range(STEPS)]
    tx = optim.differentially_private_aggregate(clip, multiplier, key=mt.random.key(42))
    state, key = tx.init(params), mt.random.key(42)
    for step_grads in per_example:
        ours, state = tx.update(step_grads, state, params)
        leaves = mt.tree.leaves(step_grads)
        # optax: clip each example to global norm clip, sum, add noise, divide by the batch
        norms = torch.sqrt(sum(leaf.reshape(batch, -1).pow(2).sum(1) for leaf in leaves))
        factors = 1 / torch.clamp(norms / clip, min=1.0)
        key, noise_key = mt.random.split(key)  # one draw for all leaves, sliced in leaf order
        sizes = [leaf[0].numel() for leaf in leaves]
        noises = mt.random.normal(noise_key, (sum(sizes),), F64).split(sizes)
        for leaf, flat, (name, got) in zip(leaves, noises, mt.tree.named_leaves(ours),
                                           strict=True):
            summed = sum(factors[i] * leaf[i] for i in range(batch))
            noise = flat.reshape(summed.shape)
            torch.testing.assert_close(got, (summed + clip * multiplier * noise) / batch,
                                       **CLOSE, msg=name)
    with pytest.raises(ValueError, match="per-example"):
        tx.update({"s": torch.ones(2), "v": torch.ones(3, 5), "t": torch.ones(2, 2, 3, 4)},
                  state, params)


@pytest.mark.parametrize("momentum,nesterov,lr", [
    (None, False, 0.3), (None, False, lambda count: 0.3), (0.9, False, 0.3), (0.9, True, 0.3)],
    ids=["plain", "schedule", "momentum", "nesterov"])
def test_dpsgd_matches_optax_dpsgd(momentum, nesterov, lr):
    """optax ``contrib.dpsgd``: the private mean (clip, sum, noise, divide), optax's ``trace``
    (``b = decay b + g``; Nesterov ``g + decay b``) where momentum is given, then ``-lr``; 50
    steps, the fused update (no momentum) and the chain alike, the state the chain's."""
    clip, multiplier, batch = 1.5, 0.7, 8
    opt = optim.dpsgd(lr, clip, multiplier, key=42, momentum=momentum, nesterov=nesterov)
    lr = lr(0) if callable(lr) else lr
    params, reference = tree(), tree()
    g = torch.Generator().manual_seed(3)
    per_example = [mt.tree.map(lambda p: torch.randn(batch, *p.shape, generator=g, dtype=F64),
                               params) for _ in range(STEPS)]
    state, key, trace = opt.init(params), mt.random.key(42), mt.tree.map(torch.zeros_like, params)
    for step_grads in per_example:
        params, state = opt.update(step_grads, state, params)
        leaves = mt.tree.leaves(step_grads)
        norms = torch.sqrt(sum(leaf.reshape(batch, -1).pow(2).sum(1) for leaf in leaves))
        factors = 1 / torch.clamp(norms / clip, min=1.0)
        key, noise_key = mt.random.split(key)
        sizes = [leaf[0].numel() for leaf in leaves]
        noises = iter(mt.random.normal(noise_key, (sum(sizes),), F64).split(sizes))
        for name, leaf in mt.tree.named_leaves(step_grads):
            private = (torch.tensordot(factors, leaf, dims=1)
                       + clip * multiplier * next(noises).reshape(leaf.shape[1:])) / batch
            if momentum is not None:
                trace[name] = momentum * trace[name] + private
                private = private + momentum * trace[name] if nesterov else trace[name]
            reference[name] = reference[name] - lr * private
            torch.testing.assert_close(params[name], reference[name], **CLOSE, msg=name)
    assert torch.equal(state[0].rng_key, key) and int(state[-1].count) == STEPS
    assert float(state[-1].lr) == pytest.approx(lr)


def test_dpsgd_refuses_what_the_chain_refuses():
    opt, params = optim.dpsgd(0.1, 1.0, 1.0, key=0), tree()
    state = opt.init(params)

    def per_example(batch: dict) -> dict:
        return {k: torch.ones(batch[k], *p.shape, dtype=F64) for k, p in params.items()}

    for grads in (mt.tree.map(torch.ones_like, params), per_example({"s": 2, "v": 3, "t": 2}),
                  per_example({"s": 0, "v": 0, "t": 0})):  # no batch dim, unlike dims, empty
        with pytest.raises(ValueError, match="per-example grads: every leaf with the same "
                                             "leading batch dim, of at least one example$"):
            opt.update(grads, state, params)
    with pytest.raises(ValueError, match="'v'"):  # a leaf missing: the chain names it
        opt.update({k: torch.ones(2, *p.shape, dtype=F64) for k, p in params.items()
                    if k != "v"}, state, params)
    with pytest.raises(ValueError, match="expected a DifferentiallyPrivateAggregateState"):
        opt.update(per_example({"s": 2, "v": 2, "t": 2}), optim.sgd(0.1).init(params), params)
    with pytest.raises(ValueError, match="nesterov needs a momentum"):
        optim.dpsgd(0.1, 1.0, 1.0, key=0, nesterov=True)


@pytest.mark.parametrize("key", [0.0, None, "0", True, torch.tensor([1, 2, 3]),
                                 torch.tensor([1.0, 2.0]), mt.random.split(mt.random.key(0), 2)],
                         ids=["float", "none", "str", "bool", "three-words", "float-tensor",
                              "batch-of-keys"])
def test_dpsgd_and_the_aggregate_refuse_what_is_no_key(key):
    """A one-line error (the suite's shape checks may word it first) at construction, not an
    AttributeError at init or a wrong draw later."""
    for build in (optim.differentially_private_aggregate, functools.partial(optim.dpsgd, 0.1)):
        with pytest.raises((ValueError, TypeCheckError)):
            build(1.0, 1.0, key=key)


# -- schedules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("exponent", [1.0, 2.5])
def test_warmup_cosine_decay_schedule_matches_optax(exponent):
    init, peak, warmup, decay_steps, end = 0.1, 1.0, 10, 40, 0.05
    schedule = optim.warmup_cosine_decay_schedule(init, peak, warmup, decay_steps, end, exponent)
    assert schedule(17) == optim.cosine_schedule(peak, decay_steps, warmup, init, end, exponent)(17)
    alpha = end / peak
    for t in range(STEPS):
        if t < warmup:  # optax linear_schedule, then cosine_decay_schedule, joined
            want = (init - peak) * (1 - t / warmup) + peak
        else:
            count = min(t - warmup, decay_steps - warmup)
            cosine = 0.5 * (1 + math.cos(math.pi * count / (decay_steps - warmup)))
            want = peak * ((1 - alpha) * cosine**exponent + alpha)
        assert schedule(t) == pytest.approx(want, rel=1e-10, abs=1e-12)
        assert float(schedule(torch.tensor(t))) == pytest.approx(want, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize(("rate", "staircase", "end"),
                         [(0.9, False, None), (0.9, True, 0.5), (1.1, False, 2.0)])
def test_exponential_decay_matches_optax(rate, staircase, end):
    init, steps, begin = 1.0, 4, 3
    schedule = optim.exponential_decay(init, steps, rate, begin, staircase, end)
    for t in range(STEPS):
        p = (t - begin) / steps
        want = init if t - begin <= 0 else init * rate ** (math.floor(p) if staircase else p)
        if end is not None:
            want = max(want, end) if rate < 1 else min(want, end)
        assert schedule(t) == pytest.approx(want, rel=1e-10)
        assert float(schedule(torch.tensor(t))) == pytest.approx(want, rel=1e-10)
    assert optim.exponential_decay(0.3, 0, 0.5)(7) == 0.3  # optax: a constant schedule


# -- inject_hyperparams keeps the params' dtype -------------------------------------------------


def test_injected_hyperparameters_move_float64_params_as_the_plain_chain():
    def adamw(lr, b1, b2, eps, weight_decay):
        return optim.chain(optim.scale_by_adam(b1, b2, eps), optim.add_decayed_weights(
            weight_decay), optim.scale_by_learning_rate(lr))

    kwargs = dict(lr=0.01, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1)
    runs = []
    for tx in (adamw(**kwargs), optim.inject_hyperparams(adamw)(**kwargs)):
        params, state = tree(), tx.init(tree())
        for g in grads(steps=20):
            updates, state = tx.update(g, state, params)
            params = optim.apply_updates(params, updates)
        runs.append(params)
    generic.assert_equal(runs[1], runs[0])


# -- the generic checks over optax's aliases -----------------------------------------------------

GENERIC = [
    generic.test_a_pure_update_writes_none_of_its_inputs,
    generic.test_a_pure_update_returns_no_memory_the_caller_holds,
    generic.test_a_donated_update_equals_the_pure_one,
    generic.test_the_update_equals_its_chain_to_rounding,
    generic.test_a_tree_of_mixed_dtypes_updates_each_leaf_as_alone,
    generic.test_updates_under_vmap_over_a_stacked_ensemble_equal_each_member,
    generic.test_the_update_is_differentiable_by_torch_func_grad_as_by_autograd,
    generic.test_learning_rate_is_the_schedules_value_at_the_last_update,
]


@pytest.mark.parametrize("check", GENERIC, ids=lambda f: f.__name__[5:])
@pytest.mark.parametrize("entry", OPTAX_ONLY, ids=str)
def test_optaxs_aliases_pass_the_generic_checks(entry, check):
    check(entry)


@pytest.mark.parametrize("entry", OPTAX_ONLY, ids=str)
def test_optaxs_aliases_round_trip_through_a_checkpoint(entry, tmp_path):
    generic.test_a_state_round_trips_through_a_checkpoint(entry, tmp_path)


@pytest.mark.parametrize("entry", OPTAX_ONLY, ids=str)
def test_optaxs_aliases_state_bytes_equal_the_init_states_buffers(entry):
    generic.test_state_bytes_equal_the_init_states_buffers(entry)


def test_polyak_sgd_keeps_no_per_leaf_state():
    params = {"w": torch.zeros(3, 4, dtype=torch.float64)}
    state = mt.optim.polyak_sgd().init(params)
    assert generic.buffer_bytes(state) == 0 == mt.accounting.state_bytes("polyak_sgd", params)
