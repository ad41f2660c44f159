"""The checkpoint format: the fields of ``state.json``, and how pytrees lie in the tensor files.

``state.json`` is checked field by field before any value is used, so a record edited by hand
is refused like a corrupt checkpoint. A pytree is saved as its leaves by
:func:`minitrain.tree.named_leaves` name plus each node's NamedTuple type, and rebuilt from the
caller's template (:func:`rebuild`): no structure comes from the file, nothing is unpickled.
"""  # noqa: E501

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from minitrain import rng, tree
from minitrain.optim import _groups as groups

__all__ = [
    "MAX_STEP", "NAMEDTUPLES_KEY", "STATE_FIELDS", "CheckpointError", "check_state_fields",
    "namedtuple_metadata", "namedtuple_mismatch", "namedtuple_types", "pickle_kind", "rebuild",
    "recorded_namedtuples", "refuse_pickle", "save_tensors", "split_leaves",
]


class CheckpointError(ValueError):
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
    step = state["step"]
    if not _is_int(step) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer in [0, 2**63), got {step!r}")
    for key in ("meta", "versions", "scalars", "files"):
        if not isinstance(state[key], dict):
            raise ValueError(f"field {key!r} is a {type(state[key]).__name__}, not an object")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in state["versions"].items()):
        raise ValueError("versions must map names to version strings")
    saved_at = state["saved_at"]
    if not (isinstance(saved_at, (int, float)) and not isinstance(saved_at, bool)
            and math.isfinite(saved_at) and saved_at >= 0):
        raise ValueError(f"saved_at must be a time in seconds, got {saved_at!r}")
    try:
        rng.check_rng_state(state["rng"])
        if state["data_generator"] is not None:
            rng.check_generator_state(state["data_generator"])
    except ValueError as exc:
        raise ValueError(f"has a bad RNG state: {exc}") from None
    _check_scalars(state["scalars"])
    _check_files(state["files"], set(file_names))


def _check_scalars(scalars: dict[str, Any]) -> None:
    if set(scalars) != {"params", "opt_state"} or not all(
        isinstance(leaves, dict)
        and all(isinstance(value, _SCALAR_TYPES) for value in leaves.values())
        for leaves in scalars.values()
    ):
        raise ValueError("scalars must hold 'params' and 'opt_state' maps of plain values")


def _check_files(files: dict[str, Any], names: set[str]) -> None:
    if set(files) != names:
        raise ValueError(f"files must list exactly {sorted(names)}")
    for name, record in files.items():
        if not (
            isinstance(record, dict)
            and set(record) == {"bytes", "sha256"}
            and _is_int(record["bytes"])
            and record["bytes"] >= 0
            and isinstance(record["sha256"], str)
            and _SHA256.fullmatch(record["sha256"])
        ):
            raise ValueError(f"record of {name} must be {{'bytes': size, 'sha256': hex digest}}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pickle_kind(head: bytes) -> str | None:
    """What a file starting with ``head`` is, if it is a pickle in disguise; else None.

    >>> import pickle
    >>> pickle_kind(pickle.dumps([1], protocol=4)[:9]), pickle_kind(b"{")
    ('a pickle', None)
    """
    if len(head) >= 9 and head[8:9] == b"{":
        return None
    # Pickle protocols 2-5 start with PROTO (0x80) and the protocol number; torch.save writes a
    # zip archive (local file header "PK\x03\x04"), whose data.pkl is a pickle.
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "a pickle"
    if head[:4] == b"PK\x03\x04":
        return "a zip archive (torch.save format)"
    return None


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


def recorded_namedtuples(blob: bytes) -> dict[str, str] | None:
    """The :func:`namedtuple_types` in a safetensors file's header (None: none recorded)."""
    length = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8:8 + length]).get("__metadata__") or {}
    if NAMEDTUPLES_KEY not in metadata:
        return None
    try:
        record = json.loads(metadata[NAMEDTUPLES_KEY])
    except ValueError:
        record = None
    if not isinstance(record, dict) or not all(
        isinstance(path, str) and isinstance(name, str) for path, name in record.items()
    ):
        raise ValueError("its record of NamedTuple types is not a map of paths to class names")
    return record


def namedtuple_mismatch(saved: dict[str, str] | None, template: dict[str, str]) -> str | None:
    """The first node whose NamedTuple type differs between checkpoint and template, in words.

    >>> namedtuple_mismatch({"0": "ScaleByRadamState"}, {"0": "ScaleByAdamState"})
    "node '0' is a ScaleByRadamState in the checkpoint but a ScaleByAdamState in the template"
    """
    if saved is None:
        return None
    for path in sorted(saved.keys() | template.keys()):
        if saved.get(path) != template.get(path):
            where = f"node {path!r}" if path else "root"
            return (f"{where} is {_kind(saved.get(path))} in the checkpoint but "
                    f"{_kind(template.get(path))} in the template")
    return None


def _kind(name: str | None) -> str:
    return f"a {name}" if name else "no NamedTuple"


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


def namedtuple_metadata(pytree: tree.PyTree) -> dict[str, str]:
    """The safetensors metadata recording the NamedTuple type of each node of ``pytree``."""
    return {NAMEDTUPLES_KEY: json.dumps(namedtuple_types(pytree), sort_keys=True)}


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``; an I/O failure there is an ``OSError`` with its errno."""
    try:
        safetensors.torch.save_file(tensors, path, metadata=metadata)
    except safetensors.SafetensorError as exc:
        # Rust's io::Error ends its message with "(os error N)".
        match = re.search(r"\(os error (\d+)\)", str(exc))
        if match is None:
            raise CheckpointError(f"cannot serialize {path.name}: {exc}") from None
        code = int(match.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def refuse_pickle(head: bytes, name: str) -> None:
    kind = pickle_kind(head)
    if kind is not None:
        raise CheckpointError(
            f"{name} is {kind}, not a minitrain checkpoint file; refusing to load it (minitrain "
            "never unpickles)"
        )


def rebuild(
    template: tree.PyTree, blob: bytes, scalars: dict[str, Any], label: str
) -> tree.PyTree:
    try:  # safetensors parses a JSON header and raw tensor bytes: no pickle, no code runs
        tensors = safetensors.torch.load(blob)
    except (safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{label} file is not valid safetensors: {exc}") from None
    template_names = {name for name, _ in tree.named_leaves(template)}
    legacy = groups.legacy_template(template, template_names, [*tensors, *scalars])
    if legacy is not None:
        return groups.like(template, rebuild(legacy, blob, scalars, label))
    for name in [*tensors, *scalars]:
        if name not in template_names:
            raise CheckpointError(
                f"{label} leaf {name!r} is in the checkpoint but not in the template; load with "
                "the model and optimizer the checkpoint was saved from"
            )
    leaves = [
        _restore_leaf(name, leaf, tensors, scalars, label)
        for name, leaf in tree.named_leaves(template)
    ]
    _check_namedtuples(template, blob, label)
    return tree.unflatten(tree.structure(template), leaves)


def _check_namedtuples(template: tree.PyTree, blob: bytes, label: str) -> None:
    """Refuse a checkpoint whose NamedTuple nodes differ from the template's."""
    try:
        mismatch = namedtuple_mismatch(recorded_namedtuples(blob), namedtuple_types(template))
    except ValueError as exc:
        raise CheckpointError(f"{label} file: {exc}") from None
    if mismatch is not None:
        raise CheckpointError(
            f"{label} {mismatch}; load with the model and optimizer the checkpoint was saved from"
        )


def _restore_leaf(
    name: str, leaf: Any, tensors: dict[str, torch.Tensor], scalars: dict[str, Any], label: str
) -> Any:
    hint = "load with the model and optimizer the checkpoint was saved from"
    if isinstance(leaf, torch.Tensor):
        if name not in tensors:
            raise CheckpointError(
                f"{label} leaf {name!r} is not a tensor in the checkpoint; {hint}"
            )
        saved = tensors[name]
        if tuple(saved.shape) != tuple(leaf.shape):
            raise CheckpointError(
                f"{label} leaf {name!r} has shape {tuple(saved.shape)} in the checkpoint but "
                f"{tuple(leaf.shape)} in the template; {hint}"
            )
        if saved.dtype != leaf.dtype:
            raise CheckpointError(
                f"{label} leaf {name!r} is {saved.dtype} in the checkpoint but {leaf.dtype} in "
                f"the template; {hint}"
            )
        return saved.to(leaf.device)
    if name not in scalars or type(scalars[name]) is not type(leaf):
        found = type(scalars[name]).__name__ if name in scalars else "missing"
        raise CheckpointError(
            f"{label} leaf {name!r} is a {type(leaf).__name__} in the template but {found} in "
            f"the checkpoint; {hint}"
        )
    return scalars[name]
