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

__all__ = [
    "seed_everything", "generator", "get_rng_state", "set_rng_state", "generator_state",
    "set_generator_state", "check_rng_state", "check_generator_state", "MAX_SEED",
    "TORCH_CPU_STATE_BYTES",
]

MAX_SEED = 2**63 - 1
"""The largest seed accepted: torch's ``manual_seed`` takes a signed 64-bit value."""

TORCH_CPU_STATE_BYTES = 5056
"""Size of a torch CPU generator's state (mt19937: 624 words, plus the Philox/normal caches)."""

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
    """Raise ``ValueError`` unless ``state`` is a generator state :func:`generator_state` wrote.

    >>> check_generator_state("AAAA")
    Traceback (most recent call last):
    ...
    ValueError: torch generator state is 3 bytes, not 5056
    """
    raw = _decode_checked(state, "torch generator state")
    if torch.device(device).type != "cpu":
        return
    if len(raw) != TORCH_CPU_STATE_BYTES:
        raise ValueError(
            f"torch generator state is {len(raw)} bytes, not {TORCH_CPU_STATE_BYTES}"
        )
    try:
        torch.Generator().set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError as exc:
        raise ValueError(f"torch generator state is not valid ({exc})") from None


def check_rng_state(state: Any) -> None:
    """Raise ``ValueError`` unless ``state`` is what :func:`get_rng_state` returns (every field)."""
    if not isinstance(state, dict):
        raise ValueError(f"rng state is a {type(state).__name__}, not a dict")
    unknown = set(state) - {"torch", "numpy", "random", "cuda"}
    if unknown:
        raise ValueError(f"rng state has unknown field(s) {sorted(unknown)}")
    for key in ("torch", "numpy", "random"):
        if key not in state:
            raise ValueError(f"rng state has no {key!r} field")
    check_generator_state(state["torch"])
    _check_numpy_state(state["numpy"])
    _check_random_state(state["random"])
    if "cuda" in state:
        cuda = state["cuda"]
        if not isinstance(cuda, list):
            raise ValueError(f"rng state 'cuda' is a {type(cuda).__name__}, not a list")
        for entry in cuda:
            _decode_checked(entry, "cuda generator state")


def _check_numpy_state(numpy_state: Any) -> None:
    fields = {"kind", "keys", "pos", "has_gauss", "cached_gaussian"}
    if not isinstance(numpy_state, dict) or set(numpy_state) != fields:
        raise ValueError(f"numpy rng state must be a dict with fields {sorted(fields)}")
    if numpy_state["kind"] != "MT19937":
        raise ValueError(f"numpy rng state kind is {numpy_state['kind']!r}, not 'MT19937'")
    if not _is_int(numpy_state["has_gauss"]) or numpy_state["has_gauss"] not in (0, 1):
        raise ValueError(f"numpy rng has_gauss must be 0 or 1, got {numpy_state['has_gauss']!r}")
    _check_mt19937(numpy_state["keys"], numpy_state["pos"], numpy_state["cached_gaussian"],
                   "numpy rng state")


def _check_random_state(random_state: Any) -> None:
    if not (isinstance(random_state, list) and len(random_state) == 3
            and isinstance(random_state[1], list) and random_state[1]):
        raise ValueError("random rng state must be [version, [624 words, pos], gauss]")
    version, internal, gauss = random_state
    if version != 3 or not _is_int(version):
        raise ValueError(f"random rng state version must be 3, got {version!r}")
    _check_mt19937(internal[:-1], internal[-1], 0.0 if gauss is None else gauss,
                   "random rng state")


def _check_mt19937(words: Any, pos: Any, gauss: Any, label: str) -> None:
    """What numpy and ``random`` take unchecked (numpy crashes on a ``pos`` past 624): 624
    words in [0, 2**32), a position in [0, 624] and a finite cached normal."""
    if not isinstance(words, list) or len(words) != _MT_WORDS:
        raise ValueError(f"{label} keys must be a list of {_MT_WORDS} integers")
    if not all(_is_int(word) and 0 <= word < 2**32 for word in words):
        raise ValueError(f"{label} keys must hold integers in [0, 2**32)")
    if not _is_int(pos) or not 0 <= pos <= _MT_WORDS:
        raise ValueError(f"{label} pos must be in [0, 624], got {pos!r}")
    if not _is_finite(gauss):
        raise ValueError(f"{label} gauss must be a finite number, got {gauss!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


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
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], np.asarray(numpy_state["keys"], dtype=np.uint32),
                         numpy_state["pos"], numpy_state["has_gauss"],
                         numpy_state["cached_gaussian"]))
    version, internal, gauss = state["random"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
