"""The family's rules as ``_streaming.c`` kernels: per update, the kernel's rule name, its
hyperparameters (after the frame the lowering prepends) and the state fields it reads and
writes, in its slot order. Each is the step of the rule's per-leaf function (``nadam_leaf``,
...) in :mod:`minitrain.optim`, with the step-dependent scalars computed here in float64; the
tests hold each equal to its rule."""

from __future__ import annotations

import math

__all__ = ["FAMILY"]


def _adadelta(step, hyper, per_step):
    rho = hyper["rho"]
    return "adadelta", [rho, 1 - rho, hyper["eps"]], ("square_avg", "acc_delta")


def _adamax(step, hyper, per_step):
    beta1, beta2 = hyper["beta1"], hyper["beta2"]
    return "adamax", [1 - beta1, beta2, hyper["eps"], 1 - beta1**step], ("exp_avg", "exp_inf")


def _asgd(step, hyper, per_step):
    eta, mu = per_step["eta"], per_step["mu"]
    return "asgd", [hyper["lambd"], -eta, mu, float(mu == 1)], ("ax",)


def _lion(step, hyper, per_step):
    return "lion", [1 - hyper["beta1"], 1 - hyper["beta2"]], ("exp_avg",)


def _nadam(step, hyper, per_step):
    # sqrt(1 - beta2^t) folded into the coefficients
    beta1, beta2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
    root = math.sqrt(1 - beta2**step)
    return "nadam", [1 - beta1, beta2, 1 - beta2, eps * root, per_step["grad_coef"] * root,
                     per_step["avg_coef"] * root], ("exp_avg", "exp_avg_sq")


def _radam(step, hyper, per_step):
    beta1, beta2, eps = hyper["beta1"], hyper["beta2"], hyper["eps"]
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * step * beta2**step / bias_correction2
    rectified = rho_t > 5.0
    factor = 0.0
    if rectified:
        rect = math.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf
                         / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
        factor = rect * math.sqrt(bias_correction2) / bias_correction1
    return "radam", [1 - beta1, beta2, 1 - beta2, eps, float(rectified), bias_correction1,
                     factor], ("exp_avg", "exp_avg_sq")


def _rprop(step, hyper, per_step):
    return "rprop", [hyper["etaminus"], hyper["etaplus"], hyper["step_size_min"],
                     hyper["step_size_max"]], ("prev", "step_size")


def _schedule_free(step, hyper, per_step):
    # the new y is y plus the change (see _family.Rule)
    beta1, beta2 = hyper["beta1"], hyper["beta2"]
    lr_t, ckp1 = per_step["lr_t"], per_step["ckp1"]
    return "schedule_free_adamw", [
        beta2, 1 - beta2, per_step["bias_correction2"], hyper["eps"], hyper["weight_decay"],
        lr_t * (beta1 * (1 - ckp1) - 1), ckp1, lr_t,
    ], ("z", "exp_avg_sq")


FAMILY = {
    "scale_by_adadelta": _adadelta,
    "scale_by_adamax": _adamax,
    "scale_by_asgd": _asgd,
    "scale_by_lion": _lion,
    "scale_by_nadam": _nadam,
    "scale_by_radam": _radam,
    "scale_by_rprop": _rprop,
    "scale_by_schedule_free_adamw": _schedule_free,
}
