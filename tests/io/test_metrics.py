"""Run logs: metrics.jsonl across resumes, TensorBoard scalars, the loss-curve PNG, its command."""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from minitrain import metrics
from minitrain.cli import cli
from minitrain.errors import StorageError
from minitrain.metrics import MetricsError, MetricsWriter, MissingExtra, read_metrics
from tests.references import require

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def log_steps(run_dir, steps, resume_step=0, **kwargs):
    with MetricsWriter(run_dir, resume_step=resume_step, **kwargs) as log:
        for step in steps:
            log.write(step, loss=10.0 / step, lr=1e-3, grad_norm=torch.tensor(0.5 * step))


def test_records_are_plain_json_lines(tmp_path):
    with MetricsWriter(tmp_path) as log:
        record = log.write(1, loss=torch.tensor(2.5), tokens_per_s=np.float32(100.0), n=np.int64(3))
        log.write(2, loss=float("nan"), step_time=float("inf"))
    assert record == {"step": 1, "loss": 2.5, "tokens_per_s": 100.0, "n": 3}
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == read_metrics(tmp_path)
    assert json.loads(lines[1]) == {"step": 2, "loss": None, "step_time": None}  # strict JSON


def test_every_line_is_on_disk_before_close(tmp_path):
    log = MetricsWriter(tmp_path)
    log.write(1, loss=1.0)
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]  # as a SIGKILL would leave it
    log.close()


def test_resume_drops_lines_past_the_resumed_step(tmp_path):
    log_steps(tmp_path, range(1, 11))
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 11, "lo')  # a line cut short by the kill
    log_steps(tmp_path, range(7, 13), resume_step=6)
    steps = [record["step"] for record in read_metrics(tmp_path)]
    assert steps == list(range(1, 13))
    uninterrupted = tmp_path / "uninterrupted"
    log_steps(uninterrupted, range(1, 13))
    assert read_metrics(tmp_path) == read_metrics(uninterrupted)


def test_a_new_run_starts_a_new_file(tmp_path):
    log_steps(tmp_path, range(1, 6))
    log_steps(tmp_path, range(1, 3))
    assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"step": 1}\nnot json\n{"step": 2}\n', "line 2 is not JSON"),
        ('{"loss": 1.0}\n', "line 1 has no integer 'step'"),
        ('[1, 2]\n{"step": 2}\n', "line 1 has no integer 'step'"),
    ],
)
def test_damaged_metrics_are_reported(tmp_path, content, message):
    (tmp_path / "metrics.jsonl").write_text(content)
    with pytest.raises(MetricsError, match=message):
        read_metrics(tmp_path)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(MetricsError, match="resume_step must be a non-negative int"):
        MetricsWriter(tmp_path, resume_step=-1)
    with pytest.raises(MetricsError, match="no metrics file"):
        read_metrics(tmp_path / "absent")


# --------------------------------------------------------------------------- TensorBoard


def read_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_tensorboard_scalars_match_the_jsonl(tmp_path):
    require("tensorboard")
    log_steps(tmp_path, range(1, 6), tensorboard=True)
    scalars = read_scalars(tmp_path / "tensorboard", "loss")
    expected = [(row["step"], row["loss"]) for row in read_metrics(tmp_path)]
    assert [step for step, _ in scalars] == [step for step, _ in expected]
    assert np.allclose([v for _, v in scalars], [v for _, v in expected])  # stored as float32


def test_tensorboard_resume_purges_the_dead_steps(tmp_path):
    require("tensorboard")
    log_steps(tmp_path, range(1, 9), tensorboard=True)
    log_steps(tmp_path, range(4, 7), resume_step=3, tensorboard=True)
    assert [step for step, _ in read_scalars(tmp_path / "tensorboard", "loss")] == [
        1,
        2,
        3,
        4,
        5,
        6,
    ]


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MissingExtra, match=r"pip install 'minitrain\[tensorboard\]'"):
        MetricsWriter(tmp_path, tensorboard=True)


# --------------------------------------------------------------------------- plot


def test_plot_writes_a_png(tmp_path):
    with MetricsWriter(tmp_path) as log:
        for step in range(1, 60):
            log.write(step, loss=5.0 / step, val_loss=6.0 / step if step % 10 == 0 else None)
    png = metrics.plot(tmp_path)
    assert png == tmp_path / "loss.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    custom = metrics.plot(tmp_path, tmp_path / "plots" / "curve.png", keys=("val_loss",))
    assert custom.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("keys", "out", "message"),
    [
        (("accuracy",), None, "no numeric values for accuracy"),
        (None, "curve.svg", "ending in .png"),
    ],
)
def test_plot_mistakes(tmp_path, keys, out, message):
    log_steps(tmp_path, [1, 2])
    with pytest.raises(MetricsError, match=message):
        metrics.plot(tmp_path, tmp_path / out if out else None, keys=keys)


def test_missing_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    log_steps(tmp_path, [1, 2])
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(MissingExtra, match=r"pip install 'minitrain\[plot\]'"):
        metrics.plot(tmp_path)


def test_plot_command(tmp_path):
    log_steps(tmp_path, range(1, 30))
    result = CliRunner().invoke(cli, ["plot", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["records"] == 29 and summary["last_step"] == 29
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG_MAGIC


def legend_of(monkeypatch):
    """The legend labels and line colours of every figure metrics.plot draws."""
    drawn = []
    real = metrics._figure

    def spy(*args, **kwargs):
        figure = real(*args, **kwargs)
        axes = figure.axes[0]
        labelled = [line for line in axes.get_lines() if not line.get_label().startswith("_")]
        drawn.append(({line.get_label(): line.get_color() for line in labelled},
                      axes.get_title()))
        return figure

    monkeypatch.setattr(metrics, "_figure", spy)
    return drawn


def test_plot_overlays_several_runs_labelled_by_directory(tmp_path, monkeypatch):
    drawn = legend_of(monkeypatch)
    runs = [tmp_path / "fp32", tmp_path / "bf16", tmp_path / "fp8"]
    for index, run in enumerate(runs):
        with MetricsWriter(run) as log:
            for step in range(1, 40 + 10 * index):
                log.write(step, loss=(5.0 + index) / step)
    png = metrics.plot(runs, tmp_path / "compare.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    (labels, title), = drawn
    assert list(labels) == [f"{run.name} (EMA 0.9)" for run in runs]
    assert len(set(labels.values())) == 3  # a colour per run
    assert title == tmp_path.name
    # several keys: run and key in each label; a run lacking a key still plots the others
    with MetricsWriter(tmp_path / "val") as log:
        for step in range(1, 6):
            log.write(step, loss=1.0 / step, val_loss=2.0 / step)
    metrics.plot([runs[0], tmp_path / "val"], tmp_path / "keys.png")
    assert list(drawn[-1][0]) == ["fp32: loss (EMA 0.9)", "val: loss", "val: val_loss"]
    # the single-run plot keeps its labels and title
    metrics.plot(runs[0])
    assert list(drawn[-1][0]) == ["loss (EMA 0.9)"] and drawn[-1][1] == "fp32"


def test_plot_of_runs_with_the_same_name_labels_them_by_path(tmp_path, monkeypatch):
    drawn = legend_of(monkeypatch)
    runs = [tmp_path / "a" / "run", tmp_path / "b" / "run"]
    for run in runs:
        log_steps(run, [1, 2, 3])
    metrics.plot(runs, tmp_path / "same.png")
    assert list(drawn[0][0]) == [str(run) for run in runs]


def test_plot_of_several_runs_mistakes(tmp_path):
    log_steps(tmp_path / "a", [1, 2])
    log_steps(tmp_path / "b", [1, 2])
    with pytest.raises(MetricsError, match="out path ending in .png"):
        metrics.plot([tmp_path / "a", tmp_path / "b"])
    with pytest.raises(MetricsError, match=r"b/metrics.jsonl has no numeric values for val_loss"):
        with MetricsWriter(tmp_path / "c") as log:
            log.write(1, val_loss=1.0)
        metrics.plot([tmp_path / "c", tmp_path / "b"], tmp_path / "x.png", keys=("val_loss",))
    with pytest.raises(MetricsError, match="no run directories"):
        metrics.plot([], tmp_path / "x.png")


def test_plot_command_over_several_runs(tmp_path):
    for name, steps in (("fp32", 30), ("bf16", 25)):
        log_steps(tmp_path / name, range(1, steps + 1))
    out = tmp_path / "compare.png"
    args = ["plot", str(tmp_path / "fp32"), str(tmp_path / "bf16"), "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["png"] == str(out) and out.read_bytes()[:8] == PNG_MAGIC
    assert [(r["run_dir"], r["last_step"]) for r in summary["runs"]] == [
        (str(tmp_path / "fp32"), 30), (str(tmp_path / "bf16"), 25)]
    text = CliRunner().invoke(cli, args)
    assert text.exit_code == 0, text.output
    assert text.output.strip() == f"wrote {out} (2 runs; fp32: 30 records, bf16: 25 records)"


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ["{tmp}/absent"], "is not a directory"),
        (None, ["{tmp}"], "no metrics file"),
        ("log", ["{tmp}", "--out", "{tmp}/x.jpg"], "ending in .png"),
        ("log", ["{tmp}", "--key", "nope"], "no numeric values for nope"),
        ("log", ["{tmp}", "{tmp}"], "pass --out PATH.png"),
        ("log", ["{tmp}", "{tmp}/absent", "--out", "{tmp}/x.png"], "absent is not a directory"),
    ],
)
def test_plot_command_mistakes(tmp_path, setup, args, message):
    if setup == "log":
        log_steps(tmp_path, [1, 2])
    result = CliRunner().invoke(cli, ["plot", *(arg.format(tmp=tmp_path) for arg in args)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


# --------------------------------------------------------------------------- OS errors


def fail_writes_to(monkeypatch, name, errno_, partial=True):
    """``os.write`` to a file named like ``name`` (a glob) writes part, then raises ``errno_``."""
    real_write = os.write

    def write(fd, data):
        if fnmatch.fnmatch(Path(os.readlink(f"/proc/self/fd/{fd}")).name, name):
            if partial and len(data) > 1:
                partial_done.append(real_write(fd, bytes(data[: len(data) // 2])))
                return partial_done[-1]
            raise OSError(errno_, os.strerror(errno_))
        return real_write(fd, data)

    partial_done = []
    monkeypatch.setattr(os, "write", write)
    return partial_done


@pytest.mark.parametrize("errno_", [errno.ENOSPC, errno.EFBIG, errno.EIO])
def test_a_failed_write_keeps_every_whole_line(tmp_path, monkeypatch, errno_):
    log = MetricsWriter(tmp_path)
    log.write(1, loss=1.0)
    log.write(2, loss=0.5)
    before = (tmp_path / "metrics.jsonl").read_bytes()
    partial = fail_writes_to(monkeypatch, "metrics.jsonl", errno_)
    with pytest.raises(StorageError) as error:
        log.write(3, loss=0.25)
    assert partial, "the injected fault wrote part of the line first"
    assert str(error.value) == (
        f"cannot write {tmp_path / 'metrics.jsonl'}: {os.strerror(errno_).lower()}"
    )
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # the half line is gone
    log.write(3, loss=0.25)  # the writer still works once the disk has room again
    log.close()
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_metrics_file_that_is_a_directory(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(StorageError, match=r"metrics.jsonl: is a directory"):
        MetricsWriter(tmp_path)
    with pytest.raises(StorageError, match=r"metrics.jsonl: is a directory"):
        MetricsWriter(tmp_path, resume_step=3)


def test_run_dir_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="not a directory"):
        MetricsWriter(tmp_path / "file" / "run")


def test_a_failed_resume_rewrite_keeps_the_old_file(tmp_path, monkeypatch):
    log_steps(tmp_path, range(1, 6))
    before = (tmp_path / "metrics.jsonl").read_bytes()
    fail_writes_to(monkeypatch, f".metrics.jsonl.{os.getpid()}-*.tmp", errno.ENOSPC)
    with pytest.raises(StorageError, match="cannot rewrite .*metrics.jsonl: no space left"):
        MetricsWriter(tmp_path, resume_step=3)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


def test_a_value_that_is_not_json_is_named(tmp_path):
    with MetricsWriter(tmp_path) as log, pytest.raises(MetricsError, match="'tags'"):
        log.write(1, loss=1.0, tags=object())
    assert read_metrics(tmp_path) == []


def test_plot_into_a_directory_or_under_a_file_is_a_storage_error(tmp_path):
    log_steps(tmp_path, range(1, 4))
    require("matplotlib")
    (tmp_path / "taken.png").mkdir()
    with pytest.raises(StorageError, match="cannot write the plot to .*taken.png: is a dir"):
        metrics.plot(tmp_path, tmp_path / "taken.png")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError, match="not a directory"):
        metrics.plot(tmp_path, tmp_path / "file" / "loss.png")


def test_plot_of_a_sweep_draws_each_member_alone_and_overlaid(tmp_path, monkeypatch):
    from minitrain import metrics
    from minitrain.precision import get_backend
    from minitrain.train.sweep import fit_sweep, load_sweep

    linreg = str(Path(__file__).resolve().parents[2] / "examples" / "linreg.py")
    sweep = tmp_path / "sweep"
    fit_sweep(load_sweep(linreg, ["lr=0.01,0.1"], steps=5), get_backend("cpu"),
              out_dir=sweep, progress=False)
    drawn = []
    figure = metrics._figure
    monkeypatch.setattr(metrics, "_figure", lambda *args: drawn.append(args) or figure(*args))
    runner = CliRunner()
    result = runner.invoke(cli, ["plot", str(sweep), "--out", str(tmp_path / "a.png"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["records"] == 10
    curves, labels, title = drawn[-1]
    assert labels == ["#0 lr=0.01 seed=0", "#1 lr=0.1 seed=0"] and title == "sweep"
    assert [curve["loss"][0] for curve in curves] == [(1, 2, 3, 4, 5)] * 2
    single = tmp_path / "single"
    log_steps(single, [1, 2, 3])
    both = runner.invoke(cli, ["plot", str(sweep), str(single), "--out", str(tmp_path / "c.png")])
    assert both.exit_code == 0, both.output
    assert drawn[-1][1] == ["sweep #0 lr=0.01 seed=0", "sweep #1 lr=0.1 seed=0", "single"]
