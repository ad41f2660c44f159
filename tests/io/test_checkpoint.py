"""Checkpoints: bit-exact round trips, RNG restore, corruption refused, atomic under crashes."""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minitrain as mt
from minitrain import checkpoint
from minitrain.checkpoint import CheckpointError
from minitrain.errors import StorageError


class AdamLikeState(NamedTuple):
    step: int
    mu: dict
    nu: dict
    max_nu: dict | None = None


def make_params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "layers": [
            {"weight": torch.randn(4, 3, generator=g), "bias": torch.randn(4, generator=g)},
            {"weight": torch.randn(2, 4, generator=g).to(torch.bfloat16)},
        ],
        "scale": torch.tensor(1.5),
        "index": torch.arange(5),
    }


def make_opt_state(params: dict, step: int = 3) -> AdamLikeState:
    floats = mt.tree.map(lambda t: t.float() * 0.1 if t.is_floating_point() else t.float(), params)
    return AdamLikeState(step=step, mu=floats, nu=mt.tree.map(lambda t: t**2, floats))


def bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, so NaN payloads and signed zeros compare exactly."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def assert_bit_equal(a, b) -> None:
    mt.tree.assert_same_structure(a, b)
    for (name, x), (_, y) in zip(mt.tree.named_leaves(a), mt.tree.named_leaves(b), strict=True):
        assert type(x) is type(y), name
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert bits(x) == bits(y), name
        else:
            assert x == y, name


def save_pair(run: Path) -> tuple[Path, Path, dict, AdamLikeState]:
    """Two checkpoints (steps 100 and 200); the newer is the one tests damage."""
    params = make_params()
    opt_state = make_opt_state(params)
    older = checkpoint.save(run, 100, params, opt_state, {"config": {"lr": 0.1}})
    newer = checkpoint.save(run, 200, make_params(1), make_opt_state(params, 4), {})
    return older, newer, params, opt_state


# --------------------------------------------------------------------------- round trips


def test_round_trip_is_bit_exact(tmp_path):
    params = make_params()
    params["layers"][0]["bias"][0] = float("nan")
    params["layers"][0]["bias"][1] = -0.0
    opt_state = make_opt_state(params)
    meta = {"config": {"lr": 0.1 + 0.2, "name": "x"}, "backend": "cpu"}
    path = checkpoint.save(tmp_path, 12, params, opt_state, meta)
    assert path == tmp_path / "checkpoints" / "step-00000012"
    assert sorted(p.name for p in path.iterdir()) == [
        "opt_state.safetensors",
        "params.safetensors",
        "state.json",
    ]
    template_params = mt.tree.zeros_like(params)
    template_opt = make_opt_state(template_params, step=0)
    loaded = checkpoint.load(path, template_params, template_opt)
    assert loaded.step == 12
    assert loaded.meta == meta
    assert isinstance(loaded.opt_state, AdamLikeState)
    assert_bit_equal(loaded.params, params)
    assert_bit_equal(loaded.opt_state, opt_state)


@pytest.mark.parametrize("header_bytes", [0x280, 0x380, 0x480, 0x580])
def test_a_safetensors_header_whose_length_starts_like_a_pickle_loads(tmp_path, header_bytes):
    # A header of 640 bytes is written as 80 02 00 ..., the bytes a pickle starts with.
    def saved(width: int) -> tuple[Path, int]:
        path = checkpoint.save(tmp_path / str(width), 1, {"w": torch.ones(2)},
                               {"k" * width: torch.zeros(3)})
        return path, int.from_bytes((path / "opt_state.safetensors").read_bytes()[:8], "little")

    low, high = 1, 2 * header_bytes  # the header grows with the key: bisect for its width
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if saved(middle)[1] < header_bytes else (low, middle)
    path, length = saved(low)
    assert length == header_bytes
    assert (path / "opt_state.safetensors").read_bytes()[:2] == bytes([0x80, header_bytes >> 8])
    loaded = checkpoint.load(path, {"w": torch.zeros(2)}, {"k" * low: torch.ones(3)})
    assert torch.equal(loaded.opt_state["k" * low], torch.zeros(3))


def test_tensors_are_stored_by_tree_names_in_plain_safetensors(tmp_path):
    params = make_params()
    path = checkpoint.save(tmp_path, 1, params, make_opt_state(params))
    # An independent reader (safetensors itself) sees the named_leaves names and values.
    stored = safetensors.torch.load_file(path / "params.safetensors")
    assert sorted(stored) == sorted(name for name, _ in mt.tree.named_leaves(params))
    assert torch.equal(stored["layers.0.weight"], params["layers"][0]["weight"])
    state = json.loads((path / "state.json").read_text())
    assert state["scalars"]["opt_state"] == {"step": 3, "max_nu": None}
    assert state["versions"]["torch"] == torch.__version__
    for name in ("params.safetensors", "opt_state.safetensors"):
        assert state["files"][name]["bytes"] == (path / name).stat().st_size


@settings(deadline=None, max_examples=25)
@given(
    shapes=st.lists(st.lists(st.integers(0, 4), max_size=3), min_size=1, max_size=4),
    dtype=st.sampled_from(
        [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32]
    ),
    scalar=st.one_of(st.integers(-(2**62), 2**62), st.floats(allow_nan=False), st.booleans()),
)
def test_round_trip_property(tmp_path_factory, shapes, dtype, scalar):
    run = tmp_path_factory.mktemp("run")
    g = torch.Generator().manual_seed(len(shapes))
    params = {f"p{i}": (torch.randn(s, generator=g) * 100).to(dtype) for i, s in enumerate(shapes)}
    opt_state = {"count": scalar, "moments": [t * 2 for t in params.values()]}
    path = checkpoint.save(run, 5, params, opt_state)
    loaded = checkpoint.load(path, mt.tree.zeros_like(params), {**opt_state, "count": scalar})
    assert_bit_equal(loaded.params, params)
    assert_bit_equal(loaded.opt_state, opt_state)


def test_adamw_state_round_trip_continues_identically(tmp_path):
    opt = mt.optim.adamw(lr=mt.optim.cosine_schedule(1e-2, decay_steps=10, warmup_steps=2))
    params = make_params()
    params = {"w": params["layers"][0]["weight"], "b": params["layers"][0]["bias"]}
    grads = mt.tree.map(torch.ones_like, params)
    state = opt.init(params)
    for _ in range(3):
        params, state = opt.update(grads, state, params)
    path = checkpoint.save(tmp_path, 3, params, state)
    loaded = checkpoint.load(path, mt.tree.zeros_like(params), opt.init(params))
    assert_bit_equal(loaded.opt_state, state)
    expected, _ = opt.update(grads, state, params)
    resumed, _ = opt.update(grads, loaded.opt_state, loaded.params)
    assert_bit_equal(resumed, expected)


def test_tied_and_view_leaves_are_saved(tmp_path):
    weight = torch.randn(4, 4)
    params = {"embed": weight, "head": weight, "row": weight[1]}
    path = checkpoint.save(tmp_path, 1, params, {})
    loaded = checkpoint.load(path, mt.tree.zeros_like(params), {})
    assert_bit_equal(loaded.params, params)


def test_load_never_unpickles(tmp_path, monkeypatch):
    params = make_params()
    path = checkpoint.save(tmp_path, 1, params, make_opt_state(params))

    def forbidden(*args, **kwargs):
        raise AssertionError("unpickling was attempted")

    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    loaded = checkpoint.load(path, params, make_opt_state(params))
    assert_bit_equal(loaded.params, params)


def test_rng_states_are_restored(tmp_path):
    mt.rng.seed_everything(3)
    sampler = torch.Generator().manual_seed(11)
    path = checkpoint.save(tmp_path, 1, {}, {}, generator=sampler)
    expected = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(3, generator=sampler))
    mt.rng.seed_everything(99)
    sampler.manual_seed(0)
    checkpoint.restore_rng(checkpoint.load(path, {}, {}), sampler)
    got = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(3, generator=sampler))
    assert torch.equal(got[0], expected[0])
    assert np.array_equal(got[1], expected[1])
    assert got[2] == expected[2]
    assert torch.equal(got[3], expected[3])


def test_restore_rng_without_saved_generator_is_an_error(tmp_path):
    path = checkpoint.save(tmp_path, 1, {}, {})
    with pytest.raises(CheckpointError, match="no data generator state"):
        checkpoint.restore_rng(checkpoint.load(path, {}, {}), torch.Generator())


def test_saving_the_same_step_again_replaces_it(tmp_path):
    checkpoint.save(tmp_path, 5, {"w": torch.zeros(2)}, {})
    path = checkpoint.save(tmp_path, 5, {"w": torch.ones(2)}, {})
    assert torch.equal(checkpoint.load(path, {"w": torch.zeros(2)}, {}).params["w"], torch.ones(2))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000005"]


# --------------------------------------------------------------------------- keep last K


def test_keep_last_k_and_later_steps_survive(tmp_path):
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, step, {"w": torch.ones(1)}, {})
    checkpoint.save(tmp_path, 100, {"w": torch.ones(1)}, {})  # a later step, e.g. a dead run's
    checkpoint.save(tmp_path, 40, {"w": torch.ones(1)}, {}, keep=2)
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    assert names == ["step-00000030", "step-00000040", "step-00000100"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("params", "opt_state", "meta", "message"),
    [
        ({"w": np.ones(2)}, {}, None, "leaf 'w' is a ndarray"),
        ({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, {}, None, "two leaves named 'a.b'"),
        ({}, {}, {"f": print}, "meta must be JSON data"),
    ],
)
def test_unsaveable_input_is_refused(tmp_path, params, opt_state, meta, message):
    with pytest.raises(CheckpointError, match=message):
        checkpoint.save(tmp_path, 1, params, opt_state, meta)
    assert checkpoint.list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("step", [-1, 2**63, True])
def test_bad_step_is_refused(tmp_path, step):
    with pytest.raises(CheckpointError, match="step must be an integer"):
        checkpoint.save(tmp_path, step, {}, {})


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ({"w": torch.zeros(3), "b": torch.zeros(2)}, r"'w' has shape \(2,\) in the checkpoint"),
        ({"w": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(2)}, "torch.float32 in"),
        ({"w": torch.zeros(2)}, "leaf 'b' is in the checkpoint but not in the template"),
        ({"w": torch.zeros(2), "b": torch.zeros(2), "c": torch.zeros(1)}, "'c' is not a tensor"),
    ],
)
def test_template_mismatch_is_refused(tmp_path, template, message):
    path = checkpoint.save(tmp_path, 1, {"w": torch.ones(2), "b": torch.ones(2)}, {"step": 1})
    with pytest.raises(CheckpointError, match=message):
        checkpoint.load(path, template, {"step": 0})
    with pytest.raises(CheckpointError, match="is a float in the template but int"):
        checkpoint.load(path, {"w": torch.ones(2), "b": torch.ones(2)}, {"step": 0.0})


# --------------------------------------------------------------------------- corruption


def cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_byte(path: Path, where: float = 0.5) -> None:
    content = bytearray(path.read_bytes())
    content[int(len(content) * where)] ^= 0x5A
    path.write_bytes(bytes(content))


def flip_state_digit(path: Path) -> None:
    """Change one digit of the saved step count: still valid JSON, so only the checksum sees it."""
    state = path.read_text()
    assert '"step": 200' in state
    path.write_text(state.replace('"step": 200', '"step": 201', 1))


def pickle_over(path: Path) -> None:
    with open(path, "wb") as handle:
        pickle.dump({"weight": [1.0, 2.0]}, handle, protocol=4)


def torch_save_over(path: Path) -> None:
    torch.save({"weight": torch.ones(2)}, path)


CORRUPTIONS = {
    "params cut in half": ("params.safetensors", cut_in_half, "bytes where"),
    "opt_state cut in half": ("opt_state.safetensors", cut_in_half, "truncated"),
    "params flipped byte": ("params.safetensors", flip_byte, "SHA-256"),
    "opt_state flipped byte": ("opt_state.safetensors", flip_byte, "SHA-256"),
    "state.json cut in half": ("state.json", cut_in_half, "not valid JSON"),
    "state.json flipped digit": ("state.json", flip_state_digit, "checksum"),
    "params is a pickle": ("params.safetensors", pickle_over, "is a pickle"),
    "params is torch.save": ("params.safetensors", torch_save_over, "torch.save format"),
    "state.json is a pickle": ("state.json", pickle_over, "never unpickles"),
    "state.json missing": ("state.json", lambda p: p.unlink(), "no state.json"),
    "params missing": ("params.safetensors", lambda p: p.unlink(), "is missing"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_is_refused_and_the_previous_one_used(tmp_path, corruption):
    file_name, damage, message = CORRUPTIONS[corruption]
    older, newer, params, opt_state = save_pair(tmp_path)
    damage(newer / file_name)
    with pytest.raises(CheckpointError, match=message) as error:
        checkpoint.load(newer, params, opt_state)
    assert "\n" not in str(error.value) and str(newer) in str(error.value)
    skipped = []
    assert checkpoint.latest_valid(tmp_path, lambda p, why: skipped.append((p, why))) == older
    assert len(skipped) == 1 and skipped[0][0] == newer and message in skipped[0][1]
    loaded = checkpoint.load(older, params, opt_state)
    assert_bit_equal(loaded.params, params)


def test_pickle_directory_posing_as_a_checkpoint_is_skipped(tmp_path, caplog):
    older, _, params, opt_state = save_pair(tmp_path)
    poser = tmp_path / "checkpoints" / "step-00000300"
    poser.mkdir()
    torch.save({"model": params}, poser / "model.pt")
    with caplog.at_level(logging.WARNING, logger="minitrain.checkpoint"):
        assert checkpoint.latest_valid(tmp_path).name == "step-00000200"
    assert "skipping checkpoint" in caplog.text and "no state.json" in caplog.text
    (tmp_path / "checkpoints" / "step-00000200" / "state.json").write_bytes(
        (poser / "model.pt").read_bytes()
    )
    assert checkpoint.latest_valid(tmp_path, lambda p, why: None) == older


def test_a_file_named_like_a_checkpoint_is_skipped(tmp_path):
    older, newer, _, _ = save_pair(tmp_path)
    (tmp_path / "checkpoints" / "step-00000900").write_bytes(pickle.dumps([1, 2]))
    reasons = []
    assert checkpoint.latest_valid(tmp_path, lambda p, why: reasons.append(why)) == newer
    assert reasons == ["not a directory (a checkpoint is a step-NNNNNNNN/ directory)"]


def test_no_valid_checkpoint_gives_none(tmp_path):
    assert checkpoint.latest_valid(tmp_path) is None
    path = checkpoint.save(tmp_path, 1, {"w": torch.ones(1)}, {})
    cut_in_half(path / "params.safetensors")
    assert checkpoint.latest_valid(tmp_path, lambda p, why: None) is None


# --------------------------------------------------------------------------- atomicity


def fail_writes(monkeypatch, name: str, errno_: int) -> None:
    """Make ``os.write`` to a file called ``name`` write half its bytes, then raise ``errno_``
    (as a disk that fills up mid-file does)."""
    real_write = os.write

    def write(fd, data):
        target = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else ""
        if Path(target).name == name:
            if len(data) > 1:
                return real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(errno_, os.strerror(errno_))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EFBIG, errno.EIO])
@pytest.mark.parametrize("where", ["state.json", "opt_state.safetensors"])
def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, errno_, where):
    older, newer, params, opt_state = save_pair(tmp_path)
    before = {p.name: p.read_bytes() for p in newer.iterdir()}
    fail_writes(monkeypatch, where, errno_)
    cause = os.strerror(errno_).lower()
    with pytest.raises(StorageError, match=f"cannot write checkpoint .*step-00000200: {cause}"):
        checkpoint.save(tmp_path, 200, make_params(5), opt_state)  # would replace step 200
    with pytest.raises(StorageError, match=cause) as error:
        checkpoint.save(tmp_path, 300, make_params(5), opt_state, keep=1)
    assert "\n" not in str(error.value)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [older.name, newer.name]
    assert {p.name: p.read_bytes() for p in newer.iterdir()} == before
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert checkpoint.latest_valid(tmp_path) == newer


SAVER = textwrap.dedent(
    """
    import sys, torch
    from minitrain import checkpoint
    run = sys.argv[1]
    print("ready", flush=True)
    for step in range(1, 10**6):
        params = {"w": torch.full((512, 1024), float(step)), "b": torch.arange(1024.0) + step}
        checkpoint.save(run, step, params, {"step": step}, keep=2)
    """
)


def test_sigkill_mid_save_never_leaves_a_bad_checkpoint(tmp_path):
    """Kill a process that saves 2 MB checkpoints in a loop at a random moment, then a second
    one that saves on top of what the first left."""
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    run = tmp_path / "run"
    chance = random.Random(0)
    last_step = 0
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(run)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(chance.uniform(0.2, 0.8))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        for path in checkpoint.list_checkpoints(run):
            checkpoint.verify(path)  # every step-NNNNNNNN name is a whole checkpoint
        latest = checkpoint.latest_valid(run)
        assert latest is not None
        template = {"w": torch.zeros(512, 1024), "b": torch.zeros(1024)}
        ckpt = checkpoint.load(latest, template, {"step": 0})
        assert ckpt.step >= last_step and ckpt.opt_state["step"] == ckpt.step
        assert bool((ckpt.params["w"] == ckpt.step).all())
        assert torch.equal(ckpt.params["b"], torch.arange(1024.0) + ckpt.step)
        last_step = ckpt.step
    assert last_step > 0
    # A later save cleans up the staging directories the killed savers left behind.
    checkpoint.save(run, 10**7 - 1, {}, {})
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]


# --------------------------------------------------------------------------- state.json fields


def edit_state(path: Path, edit) -> None:
    """Apply ``edit`` to a checkpoint's state.json and re-sign it: only the field checks see it."""
    state = json.loads((path / "state.json").read_text())
    del state["checksum"]
    edit(state)
    state["checksum"] = checkpoint._checksum(state)
    (path / "state.json").write_text(json.dumps(state))


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(state):
        target = state
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return edit


def _drop(key):
    return lambda state: state.pop(key)


STATE_EDITS = {
    "step missing": (_drop("step"), "lacks ['step']"),
    "rng missing": (_drop("rng"), "lacks ['rng']"),
    "unknown field": (_set("extra", 1), "unknown fields ['extra']"),
    "step a string": (_set("step", "200"), "step must be an integer"),
    "step a float": (_set("step", 200.0), "step must be an integer"),
    "step negative": (_set("step", -1), "step must be an integer"),
    "meta a list": (_set("meta", []), "'meta' is a list"),
    "saved_at a string": (_set("saved_at", "now"), "saved_at"),
    "versions of ints": (_set("versions", {"torch": 2}), "versions"),
    "torch rng short": (_set("rng", "torch", "AAAA"), "size to be 3"),
    "torch rng not base64": (_set("rng", "torch", "!!"), "not valid base64"),
    "torch rng garbage": (
        _set("rng", "torch", "A" * (5056 * 4 // 3 + 4)), "torch generator state"
    ),
    "numpy kind": (_set("rng", "numpy", "kind", "PCG64"), "MT19937"),
    "numpy keys short": (_set("rng", "numpy", "keys", [1, 2]), "numpy rng state is not valid"),
    "numpy key too big": (_set("rng", "numpy", "keys", [2**32] * 624), "numpy rng state is not"),
    "numpy pos": (_set("rng", "numpy", "pos", 625), "pos must be in"),
    "numpy gauss a string": (_set("rng", "numpy", "cached_gaussian", "x"), "numpy rng state"),
    "random version": (_set("rng", "random", [2, [0] * 625, None]), "must be [3, internal"),
    "random short": (_set("rng", "random", [3, [0] * 10, None]), "random rng state is not"),
    "random index": (_set("rng", "random", [3, [0] * 624 + [999], None]), "random rng state"),
    "random gauss": (_set("rng", "random", [3, [0] * 625, "x"]), "random rng gauss"),
    "numpy pos far out": (_set("rng", "numpy", "pos", 10**6), "pos must be in"),
    "data generator": (_set("data_generator", 5), "not base64 text"),
    "scalars": (_set("scalars", {"params": {}}), "scalars"),
    "scalar leaf a list": (_set("scalars", "opt_state", "step", [4]), "plain values"),
    "file bytes negative": (
        _set("files", "params.safetensors", "bytes", -1), "record of params.safetensors"
    ),
    "file digest": (_set("files", "params.safetensors", "sha256", "00"), "hex digest"),
}


@pytest.mark.parametrize("edit", sorted(STATE_EDITS))
def test_a_bad_state_field_is_skipped_like_corruption(tmp_path, edit):
    change, message = STATE_EDITS[edit]
    older, newer, params, opt_state = save_pair(tmp_path)
    edit_state(newer, change)
    with pytest.raises(CheckpointError, match=re.escape(message)) as error:
        checkpoint.load(newer, params, opt_state)
    assert "\n" not in str(error.value) and "state.json" in str(error.value)
    reasons = []
    assert checkpoint.latest_valid(tmp_path, lambda p, why: reasons.append(why)) == older
    assert len(reasons) == 1 and message in reasons[0]
    random_state, torch_state = random.getstate(), torch.get_rng_state()
    checkpoint.restore_rng(checkpoint.load(older, params, opt_state))  # the older one still works
    random.setstate(random_state), torch.set_rng_state(torch_state)


def test_an_unreadable_checkpoint_is_skipped_with_the_cause(tmp_path, monkeypatch):
    older, newer, params, opt_state = save_pair(tmp_path)
    real_read = Path.read_bytes

    def read_bytes(self):
        if self.parent == newer:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    reasons = []
    assert checkpoint.latest_valid(tmp_path, lambda p, why: reasons.append(why)) == older
    assert reasons == [f"cannot read {newer / 'state.json'}: permission denied"]


# --------------------------------------------------------------------------- names and places


def test_steps_past_10_to_the_8_get_wider_names_and_sort_by_step(tmp_path):
    for step in (99_999_999, 10**8, 2**63 - 1, 7):
        checkpoint.save(tmp_path, step, {"w": torch.ones(1)}, {}, keep=3)
    names = [p.name for p in checkpoint.list_checkpoints(tmp_path)]
    # keep=3 prunes only up to the step saved: the later ones stay (step 7 came last).
    assert names == [
        "step-00000007", "step-99999999", "step-100000000", "step-9223372036854775807"
    ]
    assert checkpoint.latest_valid(tmp_path).name == "step-9223372036854775807"
    assert checkpoint.load(checkpoint.latest_valid(tmp_path), {"w": torch.ones(1)}, {}).step == (
        2**63 - 1
    )
    # Not canonical (extra leading zeros, too long): not a checkpoint name at all.
    for name in ("step-000000001", "step-99999999999999999999"):
        (tmp_path / "checkpoints" / name).mkdir()
    assert len(checkpoint.list_checkpoints(tmp_path)) == 4


def test_checkpoints_that_is_a_file_is_a_storage_error(tmp_path):
    (tmp_path / "checkpoints").write_text("not a directory")
    with pytest.raises(StorageError, match=r"checkpoints: not a directory") as error:
        checkpoint.save(tmp_path, 1, {"w": torch.ones(1)}, {})
    assert error.value.path == str(tmp_path / "checkpoints")
    assert (tmp_path / "checkpoints").read_text() == "not a directory"
    assert checkpoint.list_checkpoints(tmp_path) == []


def test_a_failed_prune_keeps_the_new_checkpoint_and_warns(tmp_path, monkeypatch, caplog):
    older, newer, params, opt_state = save_pair(tmp_path)
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if "-pruned-" in str(dst):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with caplog.at_level(logging.WARNING, logger="minitrain.checkpoint"):
        path = checkpoint.save(tmp_path, 300, params, opt_state, keep=1)
    assert "pruning failed" in caplog.text and "read-only file system" in caplog.text
    assert checkpoint.list_checkpoints(tmp_path) == [older, newer, path]
    assert checkpoint.latest_valid(tmp_path) == path
