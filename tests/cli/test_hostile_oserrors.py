"""Hostile inputs: the operating system says no (a full disk, a file-size limit, I/O errors,
read-only or misshapen run directories, unreadable files) while training, saving, logging,
plotting or preparing data.

Expected: exit 1 with one ``error:`` line naming the path and the cause ("no space left on
device"), no traceback, every earlier checkpoint and metrics line intact, no half-written
checkpoint visible. Disk-full is injected at the write calls (``os.write`` fails part way, as a
filling disk does); the file-size limit is real (``RLIMIT_FSIZE`` in a subprocess).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
from test_hostile_harness import (
    check_clean,
    invoke,
    run,
)

from minitrain import data, metrics
from tests.references import require

CAUSE = {code: os.strerror(code).lower() for code in errno.errorcode}


def fail_writes(monkeypatch, match, errno_, after=0):
    """``os.write`` to a file whose path contains every string of ``match`` writes half its
    bytes and then raises ``errno_`` (from the ``after``-th such write on)."""
    real_write = os.write
    seen = []

    def write(fd, content):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if all(part in target for part in match):
            seen.append(target)
            if len(seen) > after:
                if len(content) > 1 and len(seen) == after + 1:
                    return real_write(fd, bytes(content[: len(content) // 2]))
                raise OSError(errno_, os.strerror(errno_))
        return real_write(fd, content)

    monkeypatch.setattr(os, "write", write)
    return seen


def no_staging_left(out):
    root = Path(out) / "checkpoints"
    return not root.is_dir() or not [p for p in root.iterdir() if p.name.startswith(".tmp")]


# --------------------------------------------------------------------------- full disks


# --------------------------------------------------------------------------- misshapen run dirs


def _file(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("in the way\n")


def _dir(path):
    path.mkdir(parents=True)


SHAPES = {  # id: (obstacle, where, exit codes, words of the error line, training may start)
    "--out is a regular file": (_file, "run", (2,), ("run", "file")),
}
OUT_OF = {"--out under a regular file": "file/run", "--out deep under a regular file": "file/a/b"}


def run_shape_case(capsys, script, tmp_path, case_id, case):
    obstacle, where, codes, words = case
    obstacle(tmp_path / where)
    out = tmp_path / OUT_OF.get(case_id, "run")
    code, stdout, err = run(capsys, script, out, "--checkpoint-every", "2")
    assert code in codes, err
    check_clean(err, *words, script=script)
    assert (tmp_path / where).exists()  # the obstacle is still what it was


@pytest.mark.parametrize("case", sorted(SHAPES))
def test_a_misshapen_run_directory(capsys, script, tmp_path, safe_signals, case):
    run_shape_case(capsys, script, tmp_path, case, SHAPES[case])


# --------------------------------------------------------------------------- plot and prepare


@pytest.fixture
def logged(tmp_path):
    with metrics.MetricsWriter(tmp_path / "run") as log:
        for step in range(1, 5):
            log.write(step, loss=1.0 / step)
    return tmp_path / "run"


def test_plot_into_a_directory(capsys, logged):
    require("matplotlib")
    (logged / "taken.png").mkdir()
    code, stdout, err = invoke(capsys, "plot", logged, "--out", logged / "taken.png")
    assert code == 1
    check_clean(err, "taken.png", "is a directory")


def test_plot_under_a_regular_file(capsys, logged):
    require("matplotlib")
    (logged / "file").write_text("x")
    code, stdout, err = invoke(capsys, "plot", logged, "--out", logged / "file" / "loss.png")
    assert code == 1
    check_clean(err, "loss.png", "not a directory")


def test_plot_on_a_full_disk_leaves_no_png(capsys, logged, monkeypatch):
    require("matplotlib")
    fail_writes(monkeypatch, ("loss.png",), errno.ENOSPC)
    code, stdout, err = invoke(capsys, "plot", logged)
    monkeypatch.undo()
    assert code == 1
    check_clean(err, "loss.png", "no space left on device")
    assert sorted(p.name for p in logged.iterdir()) == ["metrics.jsonl"]


def test_plot_of_unreadable_metrics(capsys, logged, monkeypatch):
    real_read = Path.read_bytes

    def read_bytes(self):
        if self.name == "metrics.jsonl":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, stdout, err = invoke(capsys, "plot", logged)
    monkeypatch.undo()
    assert code == 1
    check_clean(err, "metrics.jsonl", "input/output error")


@pytest.fixture
def sources(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for index in range(6):
        (root / f"m{index}.py").write_text(f"x = {index}\n")
    return root


def test_prepare_under_a_regular_file(capsys, sources, tmp_path):
    (tmp_path / "file").write_text("x")
    code, stdout, err = invoke(capsys, "prepare", "--source", sources, "--out",
                               tmp_path / "file" / "bytes")
    assert code == 1
    check_clean(err, "bytes", "not a directory")


def test_prepare_on_a_full_disk_keeps_the_old_corpus(capsys, sources, tmp_path, monkeypatch):
    data.prepare(tmp_path / "bytes", sources)
    before = {p.name: p.read_bytes() for p in (tmp_path / "bytes").iterdir()}
    real_open = open

    def open_(path, mode="r", *args, **kwargs):
        if Path(path).name == "train.bin" and "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(data, "open", open_, raising=False)
    code, stdout, err = invoke(capsys, "prepare", "--source", sources, "--out", tmp_path / "bytes")
    monkeypatch.undo()
    assert code == 1
    check_clean(err, "bytes", "no space left on device")
    assert {p.name: p.read_bytes() for p in (tmp_path / "bytes").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bytes", "src"]


def test_prepare_with_an_unreadable_source_file(capsys, sources, tmp_path, monkeypatch):
    real_read = Path.read_bytes

    def read_bytes(self):
        if self.name == "m3.py":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, stdout, err = invoke(capsys, "prepare", "--source", sources, "--out", tmp_path / "b")
    monkeypatch.undo()
    assert code == 1
    check_clean(err, "m3.py", "permission denied")
    assert not (tmp_path / "b").exists()
    assert shutil.disk_usage(tmp_path)  # and nothing half-built next to it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
