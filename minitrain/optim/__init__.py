"""Pure functional optimizers that match ``torch.optim`` step for step.

Where things live: ``base`` (transformations, ``chain``, ``as_optimizer``), ``transforms``
(per-leaf rules and clipping), ``_wrappers`` (routing, accumulating, skipping, averaging),
``leafwise`` (rules written for one leaf), ``alias`` (SGD, Adam(W), AdaGrad, RMSprop),
``_family`` (the rest of torch.optim, Lion, schedule-free AdamW), ``_optax`` (optax's own),
``_muon``, ``_adafactor``, ``schedules``, ``_plateau``, ``meta`` (unrolled updates);
``kernels/`` lowers recognised chains to fused kernels.

>>> import torch, minitrain as mt
>>> opt = mt.optim.adamw(lr=mt.optim.cosine_schedule(1e-3, decay_steps=100, warmup_steps=10))
>>> params = {"w": torch.zeros(3)}
>>> state = opt.init(params)
>>> params, state = opt.update({"w": torch.ones(3)}, state, params)
>>> mt.optim.learning_rate(state)
0.0
"""

from minitrain.optim import _family, _muon, _optax, _privacy, _wrappers, base, schedules, transforms
from minitrain.optim._adafactor import ScaleByAdafactorState, adafactor, scale_by_adafactor
from minitrain.optim._family import *  # noqa: F403
from minitrain.optim._muon import *  # noqa: F403
from minitrain.optim._optax import *  # noqa: F403
from minitrain.optim._plateau import ReduceLROnPlateauState, reduce_on_plateau
from minitrain.optim._privacy import *  # noqa: F403
from minitrain.optim._wrappers import *  # noqa: F403
from minitrain.optim.alias import adagrad, adam, adamw, rmsprop, sgd
from minitrain.optim.base import *  # noqa: F403
from minitrain.optim.leafwise import LeafBatch, leafwise
from minitrain.optim.meta import Unrolled, unroll
from minitrain.optim.schedules import *  # noqa: F403
from minitrain.optim.transforms import *  # noqa: F403

__all__ = [
    *base.__all__, "sgd", "adagrad", "rmsprop", "adam", "adamw", *schedules.__all__,
    "reduce_on_plateau", "ReduceLROnPlateauState", "unroll", "Unrolled", "leafwise", "LeafBatch",
    *transforms.__all__, *_wrappers.__all__, *_family.__all__, *_optax.__all__, *_privacy.__all__,
    "adafactor", "scale_by_adafactor", "ScaleByAdafactorState", *_muon.__all__,
]
