"""Pure functional optimizers that match ``torch.optim`` step for step.

>>> import torch, minitrain as mt
>>> opt = mt.optim.adamw(lr=mt.optim.cosine_schedule(1e-3, decay_steps=100, warmup_steps=10))
>>> params = {"w": torch.zeros(3)}
>>> state = opt.init(params)
>>> params, state = opt.update({"w": torch.ones(3)}, state, params)
>>> mt.optim.learning_rate(state)
0.0
"""

from minitrain.optim._adadelta import ScaleByAdadeltaState, adadelta, scale_by_adadelta
from minitrain.optim._adafactor import ScaleByAdafactorState, adafactor, scale_by_adafactor
from minitrain.optim._adamax import ScaleByAdamaxState, adamax, scale_by_adamax
from minitrain.optim._asgd import ScaleByAsgdState, asgd, asgd_average, scale_by_asgd
from minitrain.optim._lion import ScaleByLionState, lion, scale_by_lion
from minitrain.optim._muon import (
    muon,
    muon_momentum,
    newton_schulz,
    orthogonalize_by_newton_schulz,
    scale_by_muon,
)
from minitrain.optim._nadam import ScaleByNadamState, nadam, scale_by_nadam
from minitrain.optim._plateau import ReduceLROnPlateauState, reduce_on_plateau
from minitrain.optim._radam import ScaleByRadamState, radam, scale_by_radam
from minitrain.optim._rprop import ScaleByRpropState, rprop, scale_by_rprop
from minitrain.optim._schedule_free import (
    ScheduleFreeAdamwState,
    scale_by_schedule_free_adamw,
    schedule_free_adamw,
    schedule_free_eval_params,
)
from minitrain.optim.alias import adagrad, adam, adamw, rmsprop, sgd
from minitrain.optim.base import *  # noqa: F403  (the interface, listed below)
from minitrain.optim.base import __all__ as _base
from minitrain.optim.cyclic_schedules import *  # noqa: F403  (the schedules, listed below)
from minitrain.optim.cyclic_schedules import __all__ as _cyclic
from minitrain.optim.leafwise import LeafBatch, leafwise
from minitrain.optim.meta import Unrolled, unroll
from minitrain.optim.schedules import *  # noqa: F403  (the schedules, listed below)
from minitrain.optim.schedules import __all__ as _schedules
from minitrain.optim.transforms import *  # noqa: F403  (the building blocks, listed below)
from minitrain.optim.transforms import __all__ as _transforms

__all__ = [
    *_base,
    "sgd",
    "adagrad",
    "rmsprop",
    "adam",
    "adamw",
    *_schedules,
    *_cyclic,
    "reduce_on_plateau",
    "ReduceLROnPlateauState",
    "unroll",
    "Unrolled",
    "leafwise",
    "LeafBatch",
    *_transforms,
]

__all__ += [  # the torch.optim family beyond Adam, Lion and schedule-free AdamW
    "adadelta", "scale_by_adadelta", "ScaleByAdadeltaState",
    "adafactor", "scale_by_adafactor", "ScaleByAdafactorState",
    "adamax", "scale_by_adamax", "ScaleByAdamaxState",
    "asgd", "scale_by_asgd", "ScaleByAsgdState", "asgd_average",
    "nadam", "scale_by_nadam", "ScaleByNadamState",
    "radam", "scale_by_radam", "ScaleByRadamState",
    "rprop", "scale_by_rprop", "ScaleByRpropState",
    "muon", "scale_by_muon", "muon_momentum", "orthogonalize_by_newton_schulz", "newton_schulz",
    "lion", "scale_by_lion", "ScaleByLionState",
    "schedule_free_adamw", "scale_by_schedule_free_adamw", "ScheduleFreeAdamwState",
    "schedule_free_eval_params",
]
