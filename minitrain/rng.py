"""Seeds and RNG state: the only place that touches the global random number generators.

The chapter (3.5.3) seeds torch, numpy and ``random``; here one seed does all three, and their
states are captured and restored as JSON data, checked on scratch generators first.

>>> import torch
>>> seed_everything(0); a = torch.rand(2)
>>> seed_everything(0); b = torch.rand(2)
>>> torch.equal(a, b)
True
"""

from __future__ import annotations

import base64
import binascii
import math
import random
from typing import Any

import numpy as np
import torch

__all__ = ["seed_everything", "generator", "get_rng_state", "set_rng_state", "generator_state",
           "set_generator_state", "check_rng_state", "check_generator_state", "MAX_SEED"]

MAX_SEED = 2**63 - 1
"""The largest seed accepted: torch's ``manual_seed`` takes a signed 64-bit value."""

_MT_WORDS = 624  # mt19937's state: 624 32-bit words (numpy's and Python's random too)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), numpy and Python's ``random`` with ``seed``.

    >>> import random
    >>> seed_everything(0); round(random.random(), 4)
    0.8444
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with ``seed``."""
    return torch.Generator(device=device).manual_seed(seed)


def generator_state(g: torch.Generator) -> str:
    """A generator's state as base64 text (JSON-friendly)."""
    return _encode(g.get_state())


def set_generator_state(g: torch.Generator, state: str) -> None:
    """Restore a generator from :func:`generator_state`'s text (checked first)."""
    check_generator_state(state, g.device)
    g.set_state(_decode(state))


def check_generator_state(state: Any, device: str | torch.device = "cpu") -> None:
    """Raise ``ValueError`` unless ``state`` is a generator state :func:`generator_state` wrote
    (a CPU one is tried on a scratch generator).

    >>> check_generator_state("AAAA")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: torch generator state is not valid (Expected ... size to be 3)
    """
    raw = _decode_checked(state, "torch generator state")
    if torch.device(device).type != "cpu":
        return
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError as exc:
        raise ValueError(f"torch generator state is not valid ({exc})") from None


def check_rng_state(state: Any) -> None:
    """Raise ``ValueError`` unless ``state`` is what :func:`get_rng_state` returns: each part
    is set on a scratch generator first, after the checks numpy and ``random`` leave out."""
    if not isinstance(state, dict):
        raise ValueError(f"rng state is a {type(state).__name__}, not a dict")
    unknown = set(state) - {"torch", "numpy", "random", "cuda"}
    if unknown:
        raise ValueError(f"rng state has unknown field(s) {sorted(unknown)}")
    for key in ("torch", "numpy", "random"):
        if key not in state:
            raise ValueError(f"rng state has no {key!r} field")
    check_generator_state(state["torch"])
    numpy_state, random_state = state["numpy"], state["random"]
    fields = {"kind", "keys", "pos", "has_gauss", "cached_gaussian"}
    if not isinstance(numpy_state, dict) or set(numpy_state) != fields:
        raise ValueError(f"numpy rng state must be a dict with fields {sorted(fields)}")
    pos = numpy_state["pos"]
    if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos <= _MT_WORDS:
        # numpy takes any position and then reads past its 624 words
        raise ValueError(f"numpy rng state pos must be in [0, 624], got {pos!r}")
    if not (isinstance(random_state, list) and len(random_state) == 3 and random_state[0] == 3
            and isinstance(random_state[1], list)):
        raise ValueError("random rng state must be [3, internal state, gauss]")
    gauss = random_state[2]
    if gauss is not None and (isinstance(gauss, bool) or not isinstance(gauss, int | float)
                              or not math.isfinite(gauss)):
        raise ValueError(f"random rng gauss must be null or a number, got {gauss!r}")
    try:
        np.random.RandomState().set_state(_numpy_state(numpy_state))
    except (TypeError, ValueError, IndexError, OverflowError) as exc:
        raise ValueError(f"numpy rng state is not valid ({exc})") from None
    try:
        random.Random().setstate(_random_state(random_state))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"random rng state is not valid ({exc})") from None
    if "cuda" in state:
        cuda = state["cuda"]
        if not isinstance(cuda, list):
            raise ValueError(f"rng state 'cuda' is a {type(cuda).__name__}, not a list")
        for entry in cuda:
            _decode_checked(entry, "cuda generator state")


def _numpy_state(fields: dict[str, Any]) -> tuple:
    keys = np.asarray(fields["keys"], dtype=np.uint32)
    return fields["kind"], keys, fields["pos"], fields["has_gauss"], fields["cached_gaussian"]


def _random_state(fields: list) -> tuple:
    return fields[0], tuple(fields[1]), fields[2]


def _decode_checked(text: Any, label: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{label} is a {type(text).__name__}, not base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{label} is not valid base64") from None


def get_rng_state() -> dict[str, Any]:
    """The state of torch's CPU and CUDA generators, numpy's and ``random``'s, as JSON data."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": _encode(torch.get_rng_state()),
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "random": [version, list(internal), gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the global generators from :func:`get_rng_state`'s data (checked first: a
    ``ValueError`` leaves every generator as it was)."""
    check_rng_state(state)
    torch.set_rng_state(_decode(state["torch"]))
    np.random.set_state(_numpy_state(state["numpy"]))
    random.setstate(_random_state(state["random"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
