"""Checkpoints that survive crashes and never unpickle: safetensors for tensors, JSON for the rest.

A checkpoint is a directory ``<run>/checkpoints/step-NNNNNNNN/`` holding ``params.safetensors``,
``opt_state.safetensors`` (tensor leaves by name, and each node's NamedTuple type) and
``state.json`` (step, ``meta``, RNG states, versions, scalar leaves, each file's size and
SHA-256, and its own checksum). A save is built aside, fsynced and renamed into place, so a
reader sees the old checkpoint or the new one, never half of one (the chapter's ``torch.save``
is a pickle that a crash can tear).

>>> import tempfile, torch
>>> run = tempfile.mkdtemp()
>>> params = {"w": torch.arange(3.0)}
>>> path = save(run, 7, params, {"step": 7}, meta={"config": {"lr": 0.1}})
>>> ckpt = load(latest_valid(run), params, {"step": 0})
>>> path.name, ckpt.step, ckpt.params["w"], ckpt.meta
('step-00000007', 7, tensor([0., 1., 2.]), {'config': {'lr': 0.1}})
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import safetensors
import safetensors.torch
import torch

import minitrain
from minitrain import rng, tree
from minitrain.atomic_io import remove_stale_staging, staged_dir, storage_errors, write_new_file
from minitrain.checkpoint_state import (
    MAX_STEP,
    CheckpointError,
    check_state_fields,
    check_step,
    rebuild,
    refuse_pickle,
    save_tensors,
    split_leaves,
)
from minitrain.errors import StorageError, os_cause

__all__ = ["MAX_STEP", "Checkpoint", "CheckpointError", "Verified", "checkpoint_path",
           "latest_valid", "latest_verified", "list_checkpoints", "load", "prune", "restore_rng",
           "save", "verify"]

FORMAT = "minitrain-checkpoint"
VERSION = 1
PARAMS_FILE = "params.safetensors"
OPT_STATE_FILE = "opt_state.safetensors"
STATE_FILE = "state.json"
CHECKPOINTS = "checkpoints"
_STEP_NAME = re.compile(r"step-(\d{8,19})")
_MAX_STATE_BYTES = 64 * 2**20

logger = logging.getLogger(__name__)


class Checkpoint(NamedTuple):
    """What :func:`load` returns: the restored pytrees and the recorded state."""

    path: Path
    step: int
    params: tree.Params
    opt_state: tree.OptState
    meta: dict[str, Any]
    rng_state: dict[str, Any]
    generator_state: str | None


class Verified(NamedTuple):
    """A checkpoint read once and checked whole: its ``state.json`` and tensor files' bytes."""

    path: Path
    state: dict[str, Any]
    blobs: dict[str, bytes]


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint of ``step`` in ``run_dir``.

    >>> checkpoint_path("runs/a", 120).as_posix()
    'runs/a/checkpoints/step-00000120'
    """
    check_step(step)
    return Path(run_dir) / CHECKPOINTS / f"step-{step:08d}"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every canonically named checkpoint of ``run_dir``, oldest step first (unverified)."""
    root = Path(run_dir) / CHECKPOINTS
    with storage_errors(root, "list the checkpoints in"):
        if not root.is_dir():
            return []
        found = [path for path in root.iterdir() if _canonical_step(path.name) is not None]
    return sorted(found, key=lambda path: _canonical_step(path.name))


def _canonical_step(name: str) -> int | None:
    match = _STEP_NAME.fullmatch(name)
    if not match:
        return None
    step = int(match.group(1))
    return step if step <= MAX_STEP and name == f"step-{step:08d}" else None


def save(run_dir: str | os.PathLike, step: int, params: tree.Params, opt_state: tree.OptState,
         meta: dict[str, Any] | None = None, *, generator: torch.Generator | None = None,
         keep: int | None = None) -> Path:
    """Atomically write the checkpoint of ``step`` into ``run_dir/checkpoints``; return its path.

    ``meta`` is JSON data stored as is; ``generator`` (the data sampler's) is saved with the
    global RNGs; ``keep`` then prunes all but the newest ``keep`` up to ``step``.

    >>> import tempfile, torch
    >>> run = tempfile.mkdtemp()
    >>> for step in (1, 2, 3):
    ...     _ = save(run, step, {"w": torch.ones(2)}, (), keep=2)
    >>> [path.name for path in list_checkpoints(run)]
    ['step-00000002', 'step-00000003']
    """
    target = checkpoint_path(run_dir, step)  # checks the step
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep must be a positive integer or None, got {keep!r}")
    try:
        meta = json.loads(json.dumps(meta if meta is not None else {}))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"meta must be JSON data (dicts, lists, numbers, str): {exc}"
        ) from None
    params_tensors, params_scalars = split_leaves(params, "params")
    opt_tensors, opt_scalars = split_leaves(opt_state, "opt_state")
    body = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "meta": meta,
        "rng": rng.get_rng_state(),
        "data_generator": rng.generator_state(generator) if generator is not None else None,
        "versions": {"python": sys.version.split()[0], "minitrain": minitrain.__version__,
                     "torch": torch.__version__, "numpy": np.__version__,
                     "safetensors": safetensors.__version__},
        "saved_at": time.time(),
        "scalars": {"params": params_scalars, "opt_state": opt_scalars},
        "files": {},
    }
    with storage_errors(target.parent, "create the checkpoint directory", mkdir=True):
        target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target.parent)
    with storage_errors(target, "write checkpoint"), staged_dir(target) as staging:
        for name, tensors, pytree in ((PARAMS_FILE, params_tensors, params),
                                      (OPT_STATE_FILE, opt_tensors, opt_state)):
            body["files"][name] = save_tensors(tensors, staging / name, pytree)
        record = {**body, "checksum": _checksum(body)}
        write_new_file(staging / STATE_FILE, (json.dumps(record, indent=1) + "\n").encode())
    if keep is not None:
        try:
            prune(run_dir, keep, up_to=step)
        except (OSError, StorageError) as exc:
            logger.warning("kept older checkpoints in %s: pruning failed: %s", target.parent, exc)
    return target


def _checksum(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def prune(run_dir: str | os.PathLike, keep: int, up_to: int | None = None) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints with step <= ``up_to``; return the deleted.

    Each is renamed aside before it is deleted, so a crash never leaves half a checkpoint.
    """
    if not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"keep must be a positive integer, got {keep!r}")
    doomed = [path for path in list_checkpoints(run_dir)
              if up_to is None or _canonical_step(path.name) <= up_to][:-keep]
    for path in doomed:
        trash = path.with_name(f".tmp-{os.getpid()}-pruned-{path.name}")
        with storage_errors(path, "prune checkpoint"):
            os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def verify(path: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint directory fully (sizes, hashes, checksum); return its ``state.json``."""
    return _read_checkpoint(Path(path)).state


def latest_valid(
    run_dir: str | os.PathLike, on_skip: Callable[[Path, str], None] | None = None
) -> Path | None:
    """The path of :func:`latest_verified`'s checkpoint, or None."""
    found = latest_verified(run_dir, on_skip)
    return None if found is None else found.path


def latest_verified(
    run_dir: str | os.PathLike, on_skip: Callable[[Path, str], None] | None = None
) -> Verified | None:
    """The newest checkpoint of ``run_dir`` that passes :func:`verify`, with the bytes read for it
    (for :func:`load`), or None; each newer one that fails goes to ``on_skip(path, reason)``."""
    report = on_skip or (lambda path, why: logger.warning("skipping checkpoint %s: %s", path, why))
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return _read_checkpoint(path)
        except CheckpointError as exc:
            report(path, str(exc).removeprefix(f"checkpoint {path}: "))
    return None


def load(source: str | os.PathLike | Verified, params_template: tree.Params,
         opt_state_template: tree.OptState) -> Checkpoint:
    """Verify and load a checkpoint (or load a :class:`Verified` one) into pytrees shaped like the
    templates (nothing is unpickled).

    >>> import tempfile, torch
    >>> path = save(tempfile.mkdtemp(), 3, {"w": torch.ones(2)}, {})
    >>> load(path, {"w": torch.ones(3)}, {})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    minitrain.checkpoint_state.CheckpointError: checkpoint ...: params leaf 'w' has shape (2,) ...
    """  # noqa: E501
    path, state, blobs = source if isinstance(source, Verified) else _read_checkpoint(Path(source))
    scalars = state["scalars"]
    try:
        params = rebuild(params_template, blobs[PARAMS_FILE], scalars["params"], "params")
        opt_state = rebuild(opt_state_template, blobs[OPT_STATE_FILE], scalars["opt_state"],
                            "opt_state")
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None
    return Checkpoint(path, state["step"], params, opt_state, state["meta"], state["rng"],
                      state["data_generator"])


def restore_rng(checkpoint: Checkpoint, generator: torch.Generator | None = None) -> None:
    """Restore the global RNGs, and ``generator`` from the saved data-sampler state (both
    checked when :func:`load` read them)."""
    if generator is not None and checkpoint.generator_state is None:
        raise CheckpointError(
            f"checkpoint {checkpoint.path} holds no data generator state; it was saved "
            "without generator=..."
        )
    rng.set_rng_state(checkpoint.rng_state)
    if generator is not None:
        rng.set_generator_state(generator, checkpoint.generator_state)


def _read_checkpoint(path: Path) -> Verified:
    try:
        state = _read_state(path)
        blobs = {name: _check_file(path / name, record) for name, record in state["files"].items()}
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from None
    except OSError as exc:  # unreadable (EACCES, EIO) or gone while reading
        why = f"cannot read {exc.filename or path}: {os_cause(exc)}"
        raise CheckpointError(f"checkpoint {path}: {why}") from None
    return Verified(path, state, blobs)


def _read_state(path: Path) -> dict[str, Any]:
    step = _canonical_step(path.name)
    if step is None:
        raise CheckpointError("not a checkpoint: its name is not step-NNNNNNNN")
    if not path.is_dir():
        raise CheckpointError("not a directory (a checkpoint is a step-NNNNNNNN/ directory)")
    state_path = path / STATE_FILE
    if not state_path.is_file():
        raise CheckpointError(f"no {STATE_FILE} (an unfinished or foreign checkpoint)")
    if state_path.stat().st_size > _MAX_STATE_BYTES:
        raise CheckpointError(f"{STATE_FILE} is larger than {_MAX_STATE_BYTES} bytes")
    raw = state_path.read_bytes()
    refuse_pickle(raw, STATE_FILE)
    try:
        state = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{STATE_FILE} is not valid JSON ({exc}); truncated or corrupted"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{STATE_FILE} is not a {FORMAT} record")
    if state.get("version") != VERSION:
        raise CheckpointError(
            f"{STATE_FILE} has format version {state.get('version')!r}; this minitrain reads "
            f"version {VERSION}"
        )
    body = {key: value for key, value in state.items() if key != "checksum"}
    if state.get("checksum") != _checksum(body):
        raise CheckpointError(f"{STATE_FILE} does not match its checksum (corrupted)")
    try:
        check_state_fields(state, (PARAMS_FILE, OPT_STATE_FILE))
    except ValueError as exc:
        raise CheckpointError(f"{STATE_FILE} {exc}") from None
    if state["step"] != step:
        raise CheckpointError(f"{STATE_FILE} records step {state['step']}, not {step}")
    return state


def _check_file(path: Path, record: dict[str, Any]) -> bytes:
    if not path.is_file():
        raise CheckpointError(f"{path.name} is missing")
    content = path.read_bytes()
    refuse_pickle(content[:9], path.name)
    if len(content) != record["bytes"]:
        raise CheckpointError(
            f"{path.name} is {len(content)} bytes where {record['bytes']} were written "
            "(truncated or replaced)"
        )
    if hashlib.sha256(content).hexdigest() != record["sha256"]:
        raise CheckpointError(f"{path.name} does not match its recorded SHA-256 (corrupted)")
    return content
