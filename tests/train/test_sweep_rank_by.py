"""``minitrain sweep --rank-by [max:]METRIC``: every metric either way; a bad one is one line."""

import json
import math
import textwrap

import pytest

from minitrain.cli import main
from minitrain.errors import ExperimentError
from minitrain.precision import get_backend
from minitrain.train.ranking import LOSSES, RankBy, parse_rank_by
from minitrain.train.sweep import fit_sweep, load_sweep

CPU = get_backend("cpu")

SCRIPT = """
import torch
import minitrain as mt

CONFIG = {{"lr": 0.1, "steps": 6}}


def experiment(config):
    true_w = torch.linspace(-1.0, 1.0, 4)

    def next_batch(generator):
        x = torch.randn(8, 4, generator=generator)
        return x, x @ true_w

    def loss(params, batch):
        x, y = batch
        return ((x @ params["w"] - y) ** 2).mean()

    def evaluate(params):
        error = float((params["w"] - true_w).square().sum())
        return {{"val_loss": error, "accuracy": 1 / (1 + error), "norm": float(params["w"].norm())}}

    return mt.Experiment(init=lambda g: {{"w": torch.zeros(4)}}, loss=loss, next_batch=next_batch,
                         optimizer=mt.optim.sgd(lr=config["lr"]), steps=config["steps"],
                         {evaluate})
"""
METRICS = ["accuracy", "norm", "val_loss", *LOSSES]


def write(tmp_path, evaluate=True):
    path = tmp_path / "ranked.py"
    path.write_text(textwrap.dedent(SCRIPT).format(
        evaluate="evaluate=evaluate, eval_every=3" if evaluate else ""))
    return str(path)


@pytest.fixture(scope="module")
def sweep_rows(tmp_path_factory):
    """The ranking rows of one sweep of four learning rates and two seeds (order aside)."""
    path = write(tmp_path_factory.mktemp("ranked"))
    ensemble = load_sweep(path, ["lr=0.01,0.05,0.1,0.3"], seeds=[0, 1])
    return path, ensemble, fit_sweep(ensemble, CPU, progress=False).summary["ranking"]


def value(row, name):
    return row[LOSSES[name]] if name in LOSSES else row["eval"][name]


@pytest.mark.parametrize("higher", [False, True], ids=["min", "max"])
@pytest.mark.parametrize("name", METRICS)
def test_every_metric_ranks_members_either_way(sweep_rows, name, higher):
    path, ensemble, _ = sweep_rows
    rank_by = RankBy(name, higher)
    rows = fit_sweep(load_sweep(path, ["lr=0.01,0.05,0.1,0.3"], seeds=[0, 1]), CPU,
                     progress=False, rank_by=rank_by).summary["ranking"]
    values = [value(row, name) for row in rows]
    assert all(math.isfinite(v) for v in values)
    assert values == sorted(values, reverse=higher)
    assert [row["rank"] for row in rows] == list(range(1, len(rows) + 1))
    assert {(row["ranked_by"], row["higher_is_better"]) for row in rows} == {(name, higher)}


def test_the_default_is_val_loss_lower_first(sweep_rows):
    _, _, rows = sweep_rows
    losses = [row["eval"]["val_loss"] for row in rows]
    assert losses == sorted(losses) and rows[0]["ranked_by"] == "val_loss"
    assert not rows[0]["higher_is_better"]


@pytest.mark.parametrize("text, expected", [
    ("val_loss", RankBy("val_loss")), ("min:loss", RankBy("loss")),
    ("max:accuracy", RankBy("accuracy", True)), (" max:norm ", RankBy("norm", True)),
])
def test_parse(text, expected):
    assert parse_rank_by(text) == expected


@pytest.mark.parametrize("text", ["", "max:", "avg:loss", "a:b:c"])
def test_a_malformed_rank_by_is_one_line(text):
    with pytest.raises(ExperimentError, match="expected a metric name"):
        parse_rank_by(text)


@pytest.mark.parametrize("evaluate", [True, False], ids=["with-evaluate", "without"])
def test_an_unknown_metric_is_one_line_listing_the_available_before_the_first_step(
        tmp_path, capsys, evaluate):
    path = write(tmp_path, evaluate)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", path, "--set", "lr=0.01,0.1", "--rank-by", "max:acc", "--out", str(out),
              "--no-report", "--no-plot", "--json"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err
    available = "loss, smoothed_loss, final_loss" + (", accuracy, norm, val_loss" if evaluate
                                                     else "")
    assert lines[0].startswith(f"error: --rank-by acc: no such metric; available: {available}")
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_the_cli_ranks_by_a_metric_and_says_how_in_help(tmp_path, capsys):
    path = write(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", path, "--set", "lr=0.01,0.1,0.3", "--rank-by", "max:accuracy",
              "--no-report", "--no-plot", "--json"])
    assert exit_info.value.code == 0
    rows = json.loads(capsys.readouterr().out)["ranking"]
    accuracy = [row["eval"]["accuracy"] for row in rows]
    assert accuracy == sorted(accuracy, reverse=True)
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "lower is better" in text and "max:METRIC: higher is" in text
    assert "Default: val_loss where evaluate returns it, else loss." in text
