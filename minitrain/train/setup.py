"""Setting a run up: generators from a seed, params on the backend, checks of what init gave."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minitrain import rng
from minitrain.errors import ExperimentError
from minitrain.precision import Backend
from minitrain.train.experiment import one_line
from minitrain.train.script_errors import script_call
from minitrain.tree import Params, PyTree, leaves
from minitrain.tree import map as tree_map

__all__ = ["batch_examples", "check_params", "init_params", "probe_batch", "run_generators",
           "to_backend"]


def run_generators(seed: int) -> tuple[torch.Generator, torch.Generator]:
    """Independent ``(init, data)`` generators derived from one seed (numpy SeedSequence)."""
    init, data = (rng.generator(int(seq.generate_state(1, np.uint64)[0]))
                  for seq in np.random.SeedSequence(seed).spawn(2))
    return init, data


def to_backend(params: Params, backend: Backend) -> Params:
    """Params on the backend's device; floating leaves in its ``param_dtype``."""

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        dtype = backend.param_dtype if leaf.is_floating_point() else leaf.dtype
        return leaf.to(device=backend.device, dtype=dtype)

    return tree_map(move, params)


def init_params(experiment: Any, generator: torch.Generator, backend: Backend) -> Params:
    """``experiment.init(generator)``, checked and moved to the backend."""
    with script_call("init(generator)"):
        params = experiment.init(generator)
    check_params(params, param_dtype=backend.param_dtype)
    return to_backend(params, backend)


def probe_batch(experiment: Any, generator: torch.Generator) -> PyTree:
    """The first step's batch, drawn from a copy of ``generator`` (the run's own draws stay as
    they are), e.g. to count the matmuls a step runs."""
    probe = torch.Generator(generator.device)
    probe.set_state(generator.get_state())
    with script_call("next_batch(generator)", 1):
        return experiment.next_batch(probe)


def batch_examples(batch: Any) -> int:
    """Examples in a batch: the leading dimension of its first tensor (1 for a 0-d tensor)."""
    tensors = [leaf for leaf in leaves(batch) if isinstance(leaf, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        return 1
    return int(tensors[0].shape[0])


def check_params(params: Any, what: str = "init(generator)",
                 param_dtype: torch.dtype = torch.float32) -> None:
    """Raise :class:`ExperimentError` unless ``params`` is a pytree of float32 (or
    ``param_dtype``) tensors: a backend casts float32 params to its ``param_dtype``."""
    from minitrain.tree import named_leaves

    try:
        named = named_leaves(params)
    except (TypeError, ValueError) as exc:
        raise ExperimentError(
            f"{what} must return a pytree of tensors (dicts, lists, tuples), got "
            f"{type(params).__name__}: {one_line(exc)}"
        ) from None
    if not named:
        raise ExperimentError(f"{what} returned no tensors; return a dict of float tensors")
    for name, leaf in named:
        if not isinstance(leaf, torch.Tensor):
            raise ExperimentError(
                f"{what} returned a {type(leaf).__name__} at {name!r}; every leaf of the params "
                "must be a tensor"
            )
        if not leaf.is_floating_point():
            raise ExperimentError(
                f"{what} returned an integer tensor at {name!r} ({leaf.dtype}); params must be "
                "floating point: create them with dtype=torch.float32"
            )
        if leaf.device.type == "meta":
            raise ExperimentError(
                f"{what} returned a meta tensor (no data) at {name!r}; create the params on a "
                "real device (drop device='meta'); the run moves them to the backend's device"
            )
        if leaf.dtype not in (torch.float32, param_dtype):
            raise ExperimentError(
                f"{what} returned a {leaf.dtype} tensor at {name!r}; create the params as "
                f"torch.float32 (the backend casts them to its param dtype, here {param_dtype})"
            )
