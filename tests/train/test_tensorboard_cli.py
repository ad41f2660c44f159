"""``minitrain run --tensorboard`` end to end: TensorBoard shows what metrics.jsonl holds.

Every number of every metrics line is a TensorBoard scalar at the line's step (rounded to
float32, TensorBoard's type); a run stopped and resumed shows each step once, with the values
of a run that was never stopped; without the tensorboard package the run stops at once with
one ``error:`` line.
"""

from __future__ import annotations

import sys
import time
from numbers import Real
from pathlib import Path

import numpy as np
import pytest
from test_hostile_harness import check_clean, invoke, spawn, wait_for_lines

from minitrain import checkpoint
from minitrain.metrics import MetricsWriter, MissingExtra, read_metrics
from tests.references import require

ROOT = Path(__file__).resolve().parents[2]
LINREG = ROOT / "examples" / "linreg.py"
# The values that do not depend on the machine's speed (step_time, examples_per_s and
# rss_bytes do).
SAME_EVERY_RUN = ("loss", "lr", "grad_norm")
# examples/linreg.py with a pause before each batch, so a killed run stops mid-way.
SLOW_LINREG = f'''
import dataclasses, runpy, time

_linreg = runpy.run_path({str(LINREG)!r})
CONFIG = {{**_linreg["CONFIG"], "pause": 0.05}}


def experiment(config):
    inner = _linreg["experiment"](config)

    def next_batch(generator):
        time.sleep(config["pause"])
        return inner.next_batch(generator)

    return dataclasses.replace(inner, next_batch=next_batch)
'''


@pytest.fixture(autouse=True)
def _tensorboard():
    require("tensorboard")


def train(capsys, script, out, steps, *args):
    code, stdout, err = invoke(capsys, "run", script, "--json", "--no-report", "--tensorboard",
                               "--out", out, "--steps", steps, *args)
    assert code == 0, err
    return err


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` as TensorBoard shows the run (every event file merged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def jsonl_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The numbers of metrics.jsonl in the same shape, each rounded to float32."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            if key != "step" and isinstance(value, Real) and not isinstance(value, bool):
                series.setdefault(key, []).append((record["step"], float(np.float32(value))))
    return series


def assert_tensorboard_is_the_jsonl(run_dir: Path, steps: list[int]) -> None:
    scalars = tensorboard_scalars(run_dir)
    assert scalars == jsonl_scalars(run_dir)
    assert set(SAME_EVERY_RUN) <= set(scalars)
    for tag, points in scalars.items():
        assert [step for step, _ in points] == steps, tag


def after_the_newest_event_file(run_dir: Path) -> None:
    """Wait for the second after the newest event file's. TensorBoard reads a directory's event
    files in name order, and a name starts with the second its writer opened: a run resumed in
    the same second (in this process; a new process takes longer to start) could sort first."""
    opened = max(int(path.name.split(".")[3]) for path in (run_dir / "tensorboard").iterdir())
    while time.time() < opened + 1:
        time.sleep(0.05)


def same_every_run(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    scalars = tensorboard_scalars(run_dir)
    return {tag: scalars[tag] for tag in SAME_EVERY_RUN}


def test_every_number_of_the_jsonl_is_a_tensorboard_scalar(capsys, tmp_path):
    train(capsys, LINREG, tmp_path / "run", 7, "--log-every", "2")
    assert_tensorboard_is_the_jsonl(tmp_path / "run", [2, 4, 6, 7])


def test_each_line_reaches_tensorboard_before_the_jsonl(tmp_path):
    """Read while the writer is open, as after a kill: TensorBoard already holds every line."""
    writer = MetricsWriter(tmp_path, tensorboard=True)
    try:
        for step in range(1, 4):
            writer.write(step, loss=1.0 / step, note="text")
            assert tensorboard_scalars(tmp_path) == jsonl_scalars(tmp_path)
    finally:
        writer.close()


def test_a_run_continued_to_more_steps_shows_each_step_once(capsys, tmp_path):
    train(capsys, LINREG, tmp_path / "whole", 8)
    train(capsys, LINREG, tmp_path / "run", 4, "--checkpoint-every", "2")
    after_the_newest_event_file(tmp_path / "run")
    err = train(capsys, LINREG, tmp_path / "run", 8, "--resume")
    assert "(step 4)" in err
    assert_tensorboard_is_the_jsonl(tmp_path / "run", list(range(1, 9)))
    assert same_every_run(tmp_path / "run") == same_every_run(tmp_path / "whole")


@pytest.mark.parametrize("checkpoint_every", [10, 0], ids=["from-step-10", "from-step-0"])
def test_a_killed_run_resumed_shows_each_step_once(capsys, tmp_path, checkpoint_every):
    """The killed run logged steps past its last checkpoint (or had none): the resumed run
    hides them and logs them anew."""
    script, run_dir = tmp_path / "slow_linreg.py", tmp_path / "run"
    script.write_text(SLOW_LINREG)
    proc = spawn("run", script, "--json", "--no-report", "--tensorboard", "--out", run_dir,
                 "--steps", 200, "--checkpoint-every", checkpoint_every,
                 env={"OMP_NUM_THREADS": "1"})
    try:
        wait_for_lines(run_dir / "metrics.jsonl", 12, proc)
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    saved = checkpoint.latest_valid(run_dir)
    start = 0 if saved is None else checkpoint.verify(saved)["step"]
    assert start == checkpoint_every
    dead = [step for step, _ in tensorboard_scalars(run_dir)["loss"]]
    assert dead[:12] == list(range(1, 13)), "the killed run's steps reached TensorBoard"
    after_the_newest_event_file(run_dir)
    err = train(capsys, script, run_dir, 16, "--resume")
    assert (f"(step {start})" if start else "starting from step 0") in err
    assert_tensorboard_is_the_jsonl(run_dir, list(range(1, 17)))
    train(capsys, LINREG, tmp_path / "whole", 16)
    assert same_every_run(run_dir) == same_every_run(tmp_path / "whole")


def test_without_the_tensorboard_package_the_run_stops_with_one_line(capsys, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MissingExtra) as missing:
        MetricsWriter(tmp_path / "writer", tensorboard=True)
    code, stdout, err = invoke(capsys, "run", LINREG, "--json", "--no-report", "--tensorboard",
                               "--out", tmp_path / "run", "--steps", 3)
    assert code == 2 and not stdout
    check_clean(err, "pip install 'minitrain[tensorboard]'")
    assert f"error: {missing.value}" in err.splitlines()
    monkeypatch.undo()
    code, stdout, err = invoke(capsys, "run", LINREG, "--json", "--no-report",
                               "--out", tmp_path / "run", "--steps", 3)
    assert code == 0, "the refused run left no run behind: a rerun needs no --overwrite"


def test_tensorboard_without_out_is_refused(capsys):
    code, stdout, err = invoke(capsys, "run", LINREG, "--json", "--tensorboard", "--steps", 3)
    assert code == 2 and not stdout
    check_clean(err, "--tensorboard", "--out")
