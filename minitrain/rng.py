"""Seeds and RNG state: the only place that touches the global random number generators.

The chapter (3.5.3) seeds three libraries: torch, numpy and Python's ``random``.
:func:`seed_everything` seeds all three with one value; :func:`get_rng_state` and
:func:`set_rng_state` capture and restore them as JSON-friendly data, so a checkpoint can resume
a run bit for bit.

>>> import torch
>>> seed_everything(0); a = torch.rand(2)
>>> seed_everything(0); b = torch.rand(2)
>>> torch.equal(a, b)
True
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

__all__ = [
    "seed_everything",
    "generator",
    "get_rng_state",
    "set_rng_state",
    "generator_state",
    "set_generator_state",
]


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), numpy and Python's ``random`` with ``seed``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with ``seed``.

    >>> a = torch.rand(2, generator=generator(0))
    >>> torch.equal(a, torch.rand(2, generator=generator(0)))
    True
    """
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def generator_state(g: torch.Generator) -> str:
    """A generator's state as base64 text (JSON-friendly)."""
    return _encode(g.get_state())


def set_generator_state(g: torch.Generator, state: str) -> None:
    """Restore a generator from :func:`generator_state`'s text."""
    g.set_state(_decode(state))


def get_rng_state() -> dict[str, Any]:
    """The state of torch's CPU and CUDA generators, numpy's and ``random``'s, as JSON data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": _encode(torch.get_rng_state()),
        "numpy": {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "random": _python_random_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the global generators from :func:`get_rng_state`'s data."""
    torch.set_rng_state(_decode(state["torch"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            np.asarray(numpy_state["keys"], dtype=np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])


def _python_random_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
