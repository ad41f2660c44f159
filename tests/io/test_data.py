"""Token data: checked memmaps, get_batch against the chapter's loop, exact prefetch, prepare."""

from __future__ import annotations

import errno
import json
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from benchmarks_harness import load_benchmark
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from minitrain import data, rng
from minitrain._cache import cache_dir
from minitrain.cli import cli
from minitrain.data import DataError, get_batch, open_tokens, write_tokens
from minitrain.errors import StorageError

# The chapter's and nanoGPT's loaders, the references get_batch is checked against
chapter_get_batch = load_benchmark("data").chapter_get_batch
nanogpt_get_batch = load_benchmark("data").nanogpt_get_batch


def tokens_file(tmp_path, values, dtype="uint16"):
    return write_tokens(tmp_path / f"tokens.{dtype}.bin", np.asarray(values), dtype)


# --------------------------------------------------------------------------- token files


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_memmap_round_trip_matches_the_chapter_format(tmp_path, dtype):
    values = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    path = tokens_file(tmp_path, values, dtype)
    # The chapter's own reader: np.memmap over the tofile bytes.
    assert np.array_equal(np.memmap(path, dtype=data.TOKEN_DTYPES[dtype]), values)
    mapped = open_tokens(path, dtype, vocab_size=11)
    assert isinstance(mapped, np.memmap) and mapped.dtype == data.TOKEN_DTYPES[dtype]
    assert np.array_equal(mapped, values)


@settings(deadline=None, max_examples=30)
@given(
    values=st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=200),
    dtype=st.sampled_from(["uint16", "int32"]),
)
def test_memmap_round_trip_property(tmp_path_factory, values, dtype):
    path = tokens_file(tmp_path_factory.mktemp("t"), values, dtype)
    assert open_tokens(path, dtype, vocab_size=2**16).tolist() == values


@pytest.mark.parametrize(
    ("content", "dtype", "vocab_size", "message"),
    [
        (b"", "uint16", None, "is empty"),
        (b"\x01\x00\x02", "uint16", None, "3 bytes, not a multiple of 2"),
        (b"\x01\x00\x00\x00\x02\x00", "int32", None, "6 bytes, not a multiple of 4"),
        (np.array([1, 256, 3], np.uint16).tobytes(), "uint16", 256, "id 256 at position 1"),
        (np.array([4, -1], np.int32).tobytes(), "int32", 10, "id -1 at position 1"),
        (b"\x01\x00", "int64", None, "token dtype must be one of"),
        (b"\x01\x00", "uint16", 0, "vocab_size must be a positive integer"),
    ],
)
def test_bad_token_files_are_refused(tmp_path, content, dtype, vocab_size, message):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message) as error:
        open_tokens(path, dtype, vocab_size)
    assert "\n" not in str(error.value)


def test_missing_token_file_is_refused(tmp_path):
    with pytest.raises(DataError, match="does not exist; run 'minitrain prepare'"):
        open_tokens(tmp_path / "absent.bin")


@pytest.mark.parametrize(
    ("values", "dtype", "message"),
    [
        ([], "uint16", "non-empty 1-D"),
        ([[1, 2]], "uint16", "non-empty 1-D"),
        ([70000], "uint16", "outside what uint16 holds"),
        ([-1], "int32", "outside what int32 holds"),
        ([0.5], "int32", "must be integers"),
    ],
)
def test_write_tokens_refuses_what_the_format_cannot_hold(tmp_path, values, dtype, message):
    with pytest.raises(DataError, match=message):
        write_tokens(tmp_path / "t.bin", values, dtype)


# --------------------------------------------------------------------------- get_batch


def test_get_batch_matches_the_chapters_loop_for_the_same_draws(tmp_path):
    values = np.random.default_rng(0).integers(0, 50000, 5000).astype(np.uint16)
    tokens = open_tokens(tokens_file(tmp_path, values))
    x, y = get_batch(tokens, 8, 32, torch.Generator().manual_seed(4))
    # The chapter draws its starts from the global generator; the same seed gives the same draws.
    torch.manual_seed(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "list of ndarrays is slow"
        expected_x = chapter_get_batch(tokens, 8, 32)
    torch.manual_seed(4)
    nano_x, nano_y = nanogpt_get_batch(tokens, 8, 32)
    assert torch.equal(x, expected_x.long())
    assert torch.equal(x, nano_x) and torch.equal(y, nano_y)
    assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()


@settings(deadline=None, max_examples=40)
@given(
    length=st.integers(2, 300),
    batch_size=st.integers(1, 9),
    seq_len=st.integers(1, 299),
    seed=st.integers(0, 2**32),
)
def test_get_batch_windows_are_shifted_slices(length, batch_size, seq_len, seed):
    if seq_len >= length:
        with pytest.raises(DataError, match=f"seq_len={seq_len} must be shorter"):
            get_batch(np.arange(length), batch_size, seq_len, torch.Generator())
        return
    values = np.arange(length) * 7 % 1009  # distinct-ish ids so a wrong offset shows
    x, y = get_batch(values, batch_size, seq_len, torch.Generator().manual_seed(seed))
    assert x.shape == y.shape == (batch_size, seq_len)
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        start = next(s for s in range(length - seq_len) if values[s] == row_x[0])
        assert row_x == values[start : start + seq_len].tolist()
        assert row_y == values[start + 1 : start + 1 + seq_len].tolist()


def test_get_batch_uses_the_last_window_and_only_the_generator():
    values = np.arange(6)
    x, y = get_batch(values, 3, 5, torch.Generator().manual_seed(0))  # only start 0 fits
    assert x.tolist() == [[0, 1, 2, 3, 4]] * 3 and y.tolist() == [[1, 2, 3, 4, 5]] * 3
    starts = set()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        starts.update(get_batch(np.arange(10), 4, 3, g)[0][:, 0].tolist())
    assert starts == set(range(7))  # every start in [0, len - seq_len - 1]


def test_get_batch_is_deterministic_given_the_generator():
    values = np.arange(10_000)
    rng.seed_everything(0)
    a = get_batch(values, 4, 16, torch.Generator().manual_seed(3))
    rng.seed_everything(1)  # the global generators play no part
    b = get_batch(values, 4, 16, torch.Generator().manual_seed(3))
    c = get_batch(values, 4, 16, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize(
    ("batch_size", "seq_len", "message"),
    [(0, 4, "batch_size must be at least 1"), (2, 0, "seq_len must be at least 1")],
)
def test_get_batch_refuses_bad_sizes(batch_size, seq_len, message):
    with pytest.raises(DataError, match=message):
        get_batch(np.arange(100), batch_size, seq_len, torch.Generator())


# --------------------------------------------------------------------------- prepare


@pytest.fixture
def sources(tmp_path):
    root = tmp_path / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages").mkdir()
    for index in range(40):
        (root / "pkg" / f"m{index:02d}.py").write_text(f"value_{index} = {index}\n")
    (root / "a.py").write_text("print('a')")  # no trailing newline: one is added
    (root / "site-packages" / "skipped.py").write_text("installed = True\n")
    return root


def test_prepare_is_deterministic_and_holds_files_out(tmp_path, sources):
    first = data.prepare(tmp_path / "one", sources, val_fraction=0.2)
    second = data.prepare(tmp_path / "two", sources, val_fraction=0.2)
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert first == second
    assert first["files"]["train"] + first["files"]["val"] == 41
    assert first["files"]["val"] >= 1 and "site-packages/skipped.py" not in first["val_files"]
    prepared = data.load_prepared(tmp_path / "one")
    train_text = bytes(prepared.train.astype(np.uint8)).decode()
    val_text = bytes(prepared.val.astype(np.uint8)).decode()
    assert train_text.startswith("print('a')\n")  # sorted order: a.py before pkg/
    assert "installed" not in train_text + val_text
    for name in first["val_files"]:
        content = (sources / name).read_text()
        assert content in val_text and content not in train_text


def test_ensure_prepared_prepares_once(tmp_path, sources):
    target = tmp_path / "cache" / "bytes"
    first = data.ensure_prepared(target, sources)
    stamp = (target / "train.bin").stat().st_mtime_ns
    second = data.ensure_prepared(target, sources)
    assert (target / "train.bin").stat().st_mtime_ns == stamp
    assert np.array_equal(first.train, second.train) and first.meta == second.meta


def test_damaged_prepared_data_is_reported(tmp_path, sources):
    target = tmp_path / "bytes"
    data.prepare(target, sources)
    (target / "val.bin").write_bytes((target / "val.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match="meta.json records"):
        data.load_prepared(target)
    with pytest.raises(DataError, match="no prepared data"):
        data.load_prepared(tmp_path)


def append_byte(path):
    with open(path, "ab") as handle:
        handle.write(b"\0")


def flip_first_token(path):
    content = bytearray(path.read_bytes())
    content[0] ^= 1
    path.write_bytes(bytes(content))


@pytest.mark.parametrize(
    ("file", "damage", "message"),
    [
        ("train.bin", append_byte, "has {size} bytes but meta.json records"),
        ("val.bin", lambda p: p.write_bytes(p.read_bytes()[:-2]), "meta.json records"),
        ("train.bin", flip_first_token, "does not match the SHA-256"),
        ("train.bin", lambda p: p.unlink(), "is missing"),
        ("meta.json", lambda p: p.write_text("{"), "is not a minitrain-tokens record"),
        ("meta.json", lambda p: p.write_text(p.read_text().replace('"uint16"', '"u8"')), "dtype"),
    ],
)
def test_a_damaged_corpus_is_an_error_and_never_rebuilt(tmp_path, sources, file, damage, message):
    target = tmp_path / "bytes"
    data.prepare(target, sources)
    damage(target / file)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    size = (target / file).stat().st_size if (target / file).exists() else 0
    for load in (data.load_prepared, lambda d: data.ensure_prepared(d, sources)):
        with pytest.raises(DataError, match=message.format(size=size)) as error:
            load(target)
        assert "\n" not in str(error.value) and str(target) in str(error.value)
        assert "minitrain prepare --out" in str(error.value)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before


def test_ensure_prepared_refuses_a_corpus_from_another_source(tmp_path, sources):
    other = tmp_path / "other"
    other.mkdir()
    for name in ("x.py", "y.py"):
        (other / name).write_text(f"{name[0]} = 1\n")
    data.prepare(tmp_path / "bytes", sources)
    with pytest.raises(DataError, match="holds data prepared from .*src, not .*other"):
        data.ensure_prepared(tmp_path / "bytes", other)


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_prepare_on_a_full_disk_leaves_the_old_corpus(tmp_path, sources, monkeypatch, errno_):
    target = tmp_path / "bytes"
    data.prepare(target, sources)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    real_open = open

    class FullDisk:  # writes half of what it is given, then the OS refuses
        def __init__(self, handle):
            self.handle = handle

        def write(self, content):
            self.handle.write(content[: len(content) // 2])
            raise OSError(errno_, os.strerror(errno_))

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.handle.close()

    def open_(path, mode="r", *args, **kwargs):
        handle = real_open(path, mode, *args, **kwargs)
        return FullDisk(handle) if Path(path).name == "val.bin" and "w" in mode else handle

    monkeypatch.setattr(data, "open", open_, raising=False)
    with pytest.raises(StorageError) as error:
        data.prepare(target, sources)
    assert str(error.value) == (
        f"cannot write the prepared data to {target}: {os.strerror(errno_).lower()}"
    )
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bytes", "src"]  # no staging left


def test_an_unreadable_token_file_is_a_storage_error(tmp_path, monkeypatch):
    path = tokens_file(tmp_path, [1, 2, 3])
    real_stat = Path.stat

    def stat(self, *args, **kwargs):
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", stat)
    monkeypatch.setattr(Path, "is_file", lambda self: True)
    with pytest.raises(StorageError, match=f"cannot read {path}: permission denied"):
        open_tokens(path)


def test_prepare_refuses_to_overwrite_other_files(tmp_path, sources):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not prepared data"):
        data.prepare(tmp_path, sources)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "only.py").write_text("x = 1\n")
    with pytest.raises(DataError, match="need at least 2"):
        data.prepare(tmp_path / "out", lonely)


def test_stdlib_is_the_default_source():
    files = data.source_files(data.stdlib_dir())
    names = [path.relative_to(data.stdlib_dir()).as_posix() for path in files]
    assert "os.py" in names and names == sorted(names)
    assert not [name for name in names if "site-packages" in name]


# --------------------------------------------------------------------------- command line


def test_prepare_command(tmp_path, sources):
    runner = CliRunner()
    out = tmp_path / "bytes"
    result = runner.invoke(cli, ["prepare", "--out", str(out), "--source", str(sources), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["out"] == str(out) and summary["vocab_size"] == 256
    assert summary["tokens"]["train"] == len(data.load_prepared(out).train)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--source", "{tmp}/absent"], "does not exist"),
        (["--out", "{tmp}/file.txt"], "is a file"),
        (["--val-fraction", "1.5"], "Invalid value"),
    ],
)
def test_prepare_command_mistakes(tmp_path, sources, args, message):
    (tmp_path / "file.txt").write_text("x")
    args = [arg.format(tmp=tmp_path) for arg in args]
    if "--source" not in args:
        args += ["--source", str(sources)]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    result = CliRunner().invoke(cli, ["prepare", *args])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------- examples/bytelm.py

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "bytelm.py"
TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16, "batch_size": 3}


@pytest.fixture
def bytelm(tmp_path):
    from minitrain.train import load_experiment

    root = tmp_path / "code"
    root.mkdir()
    for index in range(30):
        body = "".join(f"def f_{index}_{k}(x):\n    return x * {k} + {index}\n" for k in range(4))
        (root / f"m{index:02d}.py").write_text(body)
    overrides = {
        "d_model": "32",
        "n_layers": "1",
        "n_heads": "2",
        "seq_len": "16",
        "batch_size": "8",
        "steps": "20",
        "warmup_steps": "3",
        "lr": "0.02",
        "eval_batches": "2",
        "data_dir": str(tmp_path / "bytes"),
        "source_dir": str(root),
    }
    return load_experiment(EXAMPLE, overrides)


def test_bytelm_prepares_its_data_and_learns(bytelm):
    import minitrain as mt

    experiment, config = bytelm
    assert (Path(config["data_dir"]) / "meta.json").is_file()  # prepared on first use
    initial = experiment.evaluate(experiment.init(torch.Generator().manual_seed(0)))
    assert abs(initial["val_bpb"] - 8.0) < 0.5  # a uniform guess over 256 bytes is 8 bits
    assert initial["val_bpb"] == pytest.approx(initial["val_loss"] / np.log(2))
    result = mt.fit(experiment, mt.get_backend("cpu"), progress=False)
    assert result.summary["eval"]["val_bpb"] < initial["val_bpb"] - 2.0


def test_bytelm_flops_formula_matches_flop_counter():
    import importlib.util

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    import minitrain as mt

    spec = importlib.util.spec_from_file_location("bytelm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    params = module.init_params(TINY, torch.Generator().manual_seed(0))
    x = torch.randint(0, 256, (TINY["batch_size"], TINY["seq_len"]))

    def loss(p):
        return mt.losses.cross_entropy(module.forward(p, x, TINY["n_heads"]), x)

    # The math kernel runs attention as bmm, which FlopCounterMode counts (the fused CPU kernel
    # has no formula there).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        mt.grad(loss)(params)
    assert counter.get_total_flops() == module.flops_per_step(TINY)


def test_bytelm_resumes_bit_identically_from_a_checkpoint(bytelm, tmp_path):
    import minitrain as mt
    from minitrain import checkpoint
    from minitrain.train import load_experiment, make_train_step

    def train(experiment, params, opt_state, generator, steps):
        step = make_train_step(experiment, mt.get_backend("cpu"))
        for _ in range(steps):
            out = step(params, opt_state, experiment.next_batch(generator))
            params, opt_state = out.params, out.opt_state
        return params, opt_state

    experiment, config = bytelm
    params = experiment.init(torch.Generator().manual_seed(0))
    opt_state = experiment.optimizer.init(params)
    expected, _ = train(experiment, params, opt_state, torch.Generator().manual_seed(1), 10)

    generator = torch.Generator().manual_seed(1)
    halfway = train(experiment, params, opt_state, generator, 4)
    checkpoint.save(tmp_path / "run", 4, *halfway, {"config": config}, generator=generator)

    # A new process: the experiment (and its prefetcher) built afresh, state from the checkpoint.
    fresh, _ = load_experiment(EXAMPLE, {key: str(value) for key, value in config.items()})
    template = fresh.init(torch.Generator().manual_seed(99))
    ckpt = checkpoint.load(
        checkpoint.latest_valid(tmp_path / "run"), template, fresh.optimizer.init(template)
    )
    resumed_generator = torch.Generator()
    checkpoint.restore_rng(ckpt, resumed_generator)
    resumed, _ = train(fresh, ckpt.params, ckpt.opt_state, resumed_generator, 6)
    for (name, a), (_, b) in zip(
        mt.tree.named_leaves(expected), mt.tree.named_leaves(resumed), strict=True
    ):
        assert torch.equal(a, b), name


GRAD_HASH = """
import hashlib, importlib.util, sys, torch
import minitrain as mt
spec = importlib.util.spec_from_file_location("bytelm_example", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
config = module.CONFIG
params = module.init_params(config, torch.Generator().manual_seed(0))
g = torch.Generator().manual_seed(1)
x = torch.randint(0, 256, (config["batch_size"], config["seq_len"]), generator=g)
grads = mt.grad(lambda p: mt.losses.cross_entropy(module.forward(p, x, config["n_heads"]), x))(
    params
)
print(hashlib.sha256(b"".join(t.numpy().tobytes() for t in mt.tree.leaves(grads))).hexdigest())
"""


def test_bytelm_gradients_are_bit_identical_across_processes():
    """Resuming in a new process needs run-to-run identical float sums on CPU (2 threads)."""
    import subprocess
    import sys

    digests = {
        subprocess.run(
            [sys.executable, "-c", GRAD_HASH, str(EXAMPLE)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for _ in range(2)
    }
    assert len(digests) == 1, digests


def test_the_corpus_lives_under_the_shared_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("MINITRAIN_CACHE_DIR", str(tmp_path / "shared"))
    assert data.default_data_dir().parent == tmp_path / "shared"
    monkeypatch.delenv("MINITRAIN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.default_data_dir().parent == tmp_path / "xdg" / "minitrain"
    assert cache_dir() == tmp_path / "xdg" / "minitrain"
    # Caches off: nothing is cached, and what needs a home gets a temporary one.
    monkeypatch.setenv("MINITRAIN_CACHE_DIR", "off")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert cache_dir() is None
    assert data.default_data_dir().parent == tmp_path / "tmp" / f"minitrain-{os.getuid()}"
