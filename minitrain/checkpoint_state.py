"""The checkpoint format: the fields of ``state.json``, and how pytrees lie in the tensor files.

``state.json`` is checked field by field before any value is used, so a record edited by hand
is refused like a corrupt checkpoint. A pytree is saved as its leaves by
:func:`minitrain.tree.named_leaves` name plus each node's NamedTuple type, and rebuilt from the
caller's template (:func:`rebuild`): no structure comes from the file, nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from minitrain import rng, tree
from minitrain.atomic_io import write_new_file
from minitrain.errors import UserError

__all__ = [
    "MAX_STEP", "NAMEDTUPLES_KEY", "STATE_FIELDS", "CheckpointError", "check_state_fields",
    "check_step", "namedtuple_types", "rebuild", "refuse_pickle", "save_tensors", "split_leaves",
]


class CheckpointError(UserError):
    """A checkpoint that is missing, damaged, not ours, or does not fit the templates."""


MAX_STEP = 2**63 - 1
"""The largest step a checkpoint can be named for: ``step-`` and up to 19 digits."""

STATE_FIELDS = frozenset({
    "format", "version", "step", "meta", "rng", "data_generator", "versions", "saved_at",
    "scalars", "files", "checksum",
})
"""The fields of ``state.json``, no more and no fewer."""

NAMEDTUPLES_KEY = "minitrain.namedtuples"
"""The key, in a tensor file's safetensors metadata, of its :func:`namedtuple_types` (JSON)."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_SCALAR_TYPES = (bool, int, float, str, type(None))
_HINT = "load with the model and optimizer the checkpoint was saved from"


def check_state_fields(state: dict[str, Any], file_names: Iterable[str]) -> None:
    """Raise ``ValueError`` (a one-line reason) unless every field of ``state`` is well formed.

    >>> check_state_fields({"format": "minitrain-checkpoint"}, ())  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: lacks ['checksum', 'data_generator', ...]
    """
    missing, unknown = STATE_FIELDS - set(state), set(state) - STATE_FIELDS
    if missing or unknown:
        raise ValueError(
            f"lacks {sorted(missing)}" if missing else f"has unknown fields {sorted(unknown)}"
        )
    check_step(state["step"])
    for key in ("meta", "versions", "scalars", "files"):
        if not isinstance(state[key], dict):
            raise ValueError(f"field {key!r} is a {type(state[key]).__name__}, not an object")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in state["versions"].items()):
        raise ValueError("versions must map names to version strings")
    saved_at = state["saved_at"]
    if not (type(saved_at) in (int, float) and math.isfinite(saved_at) and saved_at >= 0):
        raise ValueError(f"saved_at must be a time in seconds, got {saved_at!r}")
    try:
        rng.check_rng_state(state["rng"])
        if state["data_generator"] is not None:
            rng.check_generator_state(state["data_generator"])
    except ValueError as exc:
        raise ValueError(f"has a bad RNG state: {exc}") from None
    scalars = state["scalars"]
    if set(scalars) != {"params", "opt_state"} or not all(
        isinstance(leaves, dict) and all(isinstance(v, _SCALAR_TYPES) for v in leaves.values())
        for leaves in scalars.values()
    ):
        raise ValueError("scalars must hold 'params' and 'opt_state' maps of plain values")
    names = sorted(file_names)
    if sorted(state["files"]) != names:
        raise ValueError(f"files must list exactly {names}")
    for name, record in state["files"].items():
        if not (isinstance(record, dict) and set(record) == {"bytes", "sha256"}
                and type(record["bytes"]) is int and record["bytes"] >= 0
                and isinstance(record["sha256"], str) and _SHA256.fullmatch(record["sha256"])):
            raise ValueError(f"record of {name} must be {{'bytes': size, 'sha256': hex digest}}")


def check_step(step: Any) -> None:
    """Raise :class:`CheckpointError` unless ``step`` is an integer in ``[0, MAX_STEP]``."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise CheckpointError(f"step must be an integer in [0, 2**63), got {step!r}")


def refuse_pickle(head: bytes, name: str) -> None:
    """Raise :class:`CheckpointError` if a file starting with ``head`` is a pickle in disguise.

    >>> import pickle
    >>> refuse_pickle(pickle.dumps([1], protocol=4)[:9], "x.safetensors")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    minitrain.checkpoint_state.CheckpointError: x.safetensors is a pickle, not a minitrain ...
    """
    if len(head) >= 9 and head[8:9] == b"{":  # a safetensors header (or JSON at offset 8)
        return
    # Pickle protocols 2-5 start with PROTO (0x80) and the protocol number; torch.save writes a
    # zip archive (local file header "PK\x03\x04"), whose data.pkl is a pickle.
    kind = None
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        kind = "a pickle"
    elif head[:4] == b"PK\x03\x04":
        kind = "a zip archive (torch.save format)"
    if kind is not None:
        raise CheckpointError(
            f"{name} is {kind}, not a minitrain checkpoint file; refusing to load it (minitrain "
            "never unpickles)"
        )


def namedtuple_types(tree: Any, prefix: str = "") -> dict[str, str]:
    """The class name of every NamedTuple node of ``tree``, by dotted path (``""``: the root).

    >>> from collections import namedtuple
    >>> State = namedtuple("State", ["count", "mu"])
    >>> namedtuple_types((State(0, {"w": State(1, 2)}), [3]))
    {'0': 'State', '0.mu.w': 'State'}
    """
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        found, children = {prefix: type(tree).__qualname__}, zip(tree._fields, tree, strict=True)
    elif isinstance(tree, dict):
        found, children = {}, tree.items()
    elif isinstance(tree, list | tuple):
        found, children = {}, enumerate(tree)
    else:
        return {}
    for key, child in children:
        found.update(namedtuple_types(child, f"{prefix}.{key}" if prefix else str(key)))
    return found


def split_leaves(pytree: tree.PyTree, label: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensor leaves (for safetensors) and JSON scalar leaves, keyed by their dotted names."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    storages: set[tuple[str, int]] = set()
    for name, leaf in tree.named_leaves(pytree):
        if name in tensors or name in scalars:
            raise CheckpointError(
                f"{label} has two leaves named {name!r}; rename keys so dotted paths are unique"
            )
        if isinstance(leaf, torch.Tensor):
            tensor = leaf.detach().cpu().contiguous()
            storage = (str(leaf.device), tensor.untyped_storage().data_ptr())
            if storage in storages and tensor.numel():
                tensor = tensor.clone()  # safetensors refuses tensors that share memory
            storages.add(storage)
            tensors[name] = tensor
        elif isinstance(leaf, _SCALAR_TYPES):
            scalars[name] = leaf
        else:
            raise CheckpointError(
                f"{label} leaf {name!r} is a {type(leaf).__name__}; checkpoints hold tensors "
                "and plain bool/int/float/str/None leaves only"
            )
    return tensors, scalars


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, pytree: tree.PyTree
                 ) -> dict[str, Any]:
    """Write ``tensors`` and ``pytree``'s :func:`namedtuple_types` as a new safetensors file
    (fsynced); return its ``state.json`` record: size and SHA-256."""
    metadata = {NAMEDTUPLES_KEY: json.dumps(namedtuple_types(pytree), sort_keys=True)}
    data = safetensors.torch.save(tensors, metadata=metadata)
    write_new_file(path, data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def rebuild(
    template: tree.PyTree, blob: bytes, scalars: dict[str, Any], label: str
) -> tree.PyTree:
    """The pytree saved in ``blob`` (and ``scalars``), in ``template``'s structure, after
    checking every leaf's name, type, shape and dtype and every node's NamedTuple type."""
    try:  # safetensors parses a JSON header and raw tensor bytes: no pickle, no code runs
        tensors = safetensors.torch.load(blob)
    except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{label} file is not valid safetensors: {exc}") from None
    named = tree.named_leaves(template)
    template_names = {name for name, _ in named}
    for name in [*tensors, *scalars]:
        if name not in template_names:
            raise CheckpointError(
                f"{label} leaf {name!r} is in the checkpoint but not in the template; {_HINT}"
            )
    leaves = [_restore_leaf(name, leaf, tensors, scalars, label) for name, leaf in named]
    _check_namedtuples(template, blob, label)
    return tree.unflatten(tree.structure(template), leaves)


def _check_namedtuples(template: tree.PyTree, blob: bytes, label: str) -> None:
    """Refuse a checkpoint whose NamedTuple nodes differ from the template's (one saved before
    they were recorded passes)."""
    length = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8:8 + length]).get("__metadata__") or {}
    if NAMEDTUPLES_KEY not in metadata:
        return
    try:
        saved = json.loads(metadata[NAMEDTUPLES_KEY])
    except ValueError:
        saved = None
    if not isinstance(saved, dict) or not all(
        isinstance(path, str) and isinstance(name, str) for path, name in saved.items()
    ):
        raise CheckpointError(
            f"{label} file: its record of NamedTuple types is not a map of paths to class names"
        )
    expected = namedtuple_types(template)
    for path in sorted(saved.keys() | expected.keys()):
        if saved.get(path) != expected.get(path):
            was, want = (f"a {n}" if n else "no NamedTuple" for n in (saved.get(path),
                                                                      expected.get(path)))
            raise CheckpointError(
                f"{label} {f'node {path!r}' if path else 'root'} is {was} in the checkpoint "
                f"but {want} in the template; {_HINT}"
            )


def _restore_leaf(
    name: str, leaf: Any, tensors: dict[str, torch.Tensor], scalars: dict[str, Any], label: str
) -> Any:
    what = f"{label} leaf {name!r}"
    if not isinstance(leaf, torch.Tensor):
        if name not in scalars or type(scalars[name]) is not type(leaf):
            found = type(scalars[name]).__name__ if name in scalars else "missing"
            raise CheckpointError(f"{what} is a {type(leaf).__name__} in the template but "
                                  f"{found} in the checkpoint; {_HINT}")
        return scalars[name]
    if name not in tensors:
        raise CheckpointError(f"{what} is not a tensor in the checkpoint; {_HINT}")
    saved = tensors[name]
    if saved.shape != leaf.shape:
        raise CheckpointError(f"{what} has shape {tuple(saved.shape)} in the checkpoint but "
                              f"{tuple(leaf.shape)} in the template; {_HINT}")
    if saved.dtype != leaf.dtype:
        raise CheckpointError(f"{what} is {saved.dtype} in the checkpoint but {leaf.dtype} in "
                              f"the template; {_HINT}")
    return saved.to(leaf.device)
