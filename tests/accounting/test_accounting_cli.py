"""``minitrain estimate`` and ``minitrain hardware``: the chapter's scenarios from the shell."""

import json

import pytest

from minitrain.cli import main
from tests.references import require


def invoke(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def as_json(capsys, *args):
    code, out, err = invoke(capsys, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def test_estimate_time_scenario_1(capsys):
    result = as_json(capsys, "estimate", "time", "--params", "70e9", "--tokens", "15e12",
                     "--hardware", "h100", "--gpus", "1024", "--mfu", "0.5")
    assert result["flops"] == pytest.approx(6.3e24)
    assert round(result["days"]) == 144
    assert result["seconds"] == pytest.approx(result["days"] * 86400)
    assert result["rounded_flops_per_second"] == 5e17
    assert round(result["days_at_rounded_throughput"]) == 146
    code, text, _ = invoke(capsys, "estimate", "time", "--params", "70B", "--tokens", "15T",
                           "--gpus", "1024")
    assert code == 0 and "143.9 days" in text and "145.8 days" in text


def test_estimate_memory_scenario_2(capsys):
    result = as_json(capsys, "estimate", "memory", "--hardware", "h100", "--gpus", "8",
                     "--optimizer", "adamw", "--precision", "fp32")
    assert abs(result["max_params"] - 40e9) <= 1e9
    assert result["bytes_per_param"]["total"] == 16
    assert result["table"]["sgd"]["total"] == 8
    assert result["max_params_by_zero_stage"]["0"] == pytest.approx(80e9 / 16)


def test_estimate_transformer_preset(capsys):
    result = as_json(capsys, "estimate", "transformer", "--preset", "gpt2-xl", "--batch", "4",
                     "--tokens", "1e9")
    assert result["params"] == 1_557_611_200
    assert result["flops_per_token"] > result["flops_per_token_6n"] * 0.99
    assert result["training_flops"] == pytest.approx(result["flops_per_token"] * 1e9)
    memory = result["memory_per_gpu"]
    assert memory["total"] == pytest.approx(sum(v for k, v in memory.items() if k != "total"))
    full = as_json(capsys, "estimate", "transformer", "--preset", "gpt2-xl", "--batch", "4",
                   "--recompute", "full")
    assert full["memory_per_gpu"]["activations"] < memory["activations"] / 10
    # Per layer, Korthikanti et al. 2022 at 16-bit: eq. 1, eq. 6 (selective), a fused kernel.
    s, b, h, a = 1024, 4, 1600, 25
    assert result["activations_per_layer"] == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    selective = as_json(capsys, "estimate", "transformer", "--preset", "gpt2-xl", "--batch", "4",
                        "--recompute", "selective")
    assert selective["activations_per_layer"] == 34 * s * b * h
    flash = as_json(capsys, "estimate", "transformer", "--preset", "gpt2-xl", "--batch", "4",
                    "--attention", "flash")
    assert flash["attention"] == "flash"
    assert flash["activations_per_layer"] == 34 * s * b * h + 4 * a * s * b


def test_hardware_lists_the_registry_with_sources(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MINITRAIN_CACHE_DIR", str(tmp_path))
    records = as_json(capsys, "hardware")
    names = {record["name"] for record in records}
    assert {"h100", "h200", "a100-40gb", "a100-80gb", "b200", "cpu"} <= names
    h100 = as_json(capsys, "hardware", "h100")
    assert h100["peak_flops"]["bf16"] == 989.4e12
    assert h100["sparse_flops"]["bf16"] == 2 * 989.4e12
    assert round(h100["intensity_bf16"]) == 295


@pytest.mark.parametrize(
    "args, message",
    [
        (("estimate", "time", "--params", "lots", "--tokens", "1"), "not a finite number"),
        (("estimate", "time", "--params", "1", "--tokens", "1", "--hardware", "tpu"),
         "unknown hardware"),
        (("estimate", "time", "--params", "1", "--tokens", "1", "--dtype", "fp5"),
         "unknown dtype"),
        (("estimate", "memory", "--optimizer", "no-such-optimizer"), "unknown optimizer"),
        (("estimate", "transformer", "--preset", "gpt9"), "unknown preset"),
        (("hardware", "abacus"), "unknown hardware"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(capsys, args, message):
    code, _, err = invoke(capsys, *args)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


# -- estimate step ------------------------------------------------------------------------------

EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[2] / "examples"

DATA_DEPENDENT = '''
import torch
import minitrain as mt

CONFIG = {"kind": "item"}


def experiment(config):
    def loss(params, x):
        y = x @ params["w"]
        if config["kind"] == "item":
            return (y / float(y.abs().max().item())).square().mean()
        if config["kind"] == "mask":
            return y[y > 0].square().mean()
        return y.square().mean()

    return mt.Experiment(init=lambda g: {"w": torch.randn(4, 2, generator=g)}, loss=loss,
                         next_batch=lambda g: torch.randn(8, 4, generator=g),
                         optimizer=mt.optim.sgd(lr=0.1), steps=1)
'''


def test_estimate_step_predicts_what_one_real_step_measures(capsys):
    require("transformers")
    script = str(EXAMPLES / "gpt2.py")
    # A norm bound every step exceeds: the measured step clips (multiplies) as predicted.
    clip = ("--set", "max_grad_norm=1e-9")
    predicted = as_json(capsys, "estimate", "step", script, "--set", "n_layer=1", *clip)
    measured = as_json(capsys, "estimate", "step", script, "--set", "n_layer=1", *clip,
                       "--measure")
    assert not predicted["measured"] and measured["measured"]
    assert predicted["params"] == measured["params"]
    assert predicted["flops"] == measured["flops"]
    assert predicted["matmul_flops"] == measured["matmul_flops"]
    assert abs(predicted["peak_bytes"] / measured["peak_bytes"] - 1) < 0.10
    assert predicted["fits"] and predicted["seconds_per_step"] > 0
    assert predicted["memory"]["saved_for_backward"] > 0
    # Two devices: half the batch each, so fewer FLOPs and a smaller peak per device.
    halves = as_json(capsys, "estimate", "step", script, "--set", "n_layer=1", "--gpus", "2")
    assert halves["flops"] < predicted["flops"] and halves["peak_bytes"] < predicted["peak_bytes"]
    # bf16 autocast: predicted as one real step under the same autocast measures.
    bf16 = [as_json(capsys, "estimate", "step", script, "--set", "n_layer=1", *clip,
                    "--autocast", "bf16", *extra) for extra in ((), ("--measure",))]
    assert bf16[0]["peak_bytes"] == pytest.approx(bf16[1]["peak_bytes"], rel=0.01)
    assert bf16[0]["flops"] == bf16[1]["flops"] and bf16[0]["dtype"] == "bf16"
    assert bf16[0]["peak_bytes"] < predicted["peak_bytes"]
    code, text, _ = invoke(capsys, "estimate", "step", script, "--set", "n_layer=1",
                           "--hardware", "a100-80gb")
    assert code == 0 and "fits on a100-80gb" in text and "saved for backward" in text


@pytest.mark.parametrize("kind, op", [("item", "aten._local_scalar_dense"),
                                      ("mask", "aten.nonzero")])
def test_estimate_step_that_needs_data_is_one_line_suggesting_measure(capsys, tmp_path, kind, op):
    script = tmp_path / "needs_data.py"
    script.write_text(DATA_DEPENDENT)
    code, _, err = invoke(capsys, "estimate", "step", str(script), "--set", f"kind={kind}")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert op in err and "--measure" in err
    measured = as_json(capsys, "estimate", "step", str(script), "--set", f"kind={kind}",
                       "--measure")
    assert measured["measured"] and measured["peak_bytes"] > 0


@pytest.mark.parametrize(
    "args, message",
    [
        (("estimate", "step", "no_such_script.py"), "no such experiment script"),
        (("estimate", "step", str(EXAMPLES / "linreg.py"), "--set", "lrr=1"),
         "unknown config key"),
        (("estimate", "step", str(EXAMPLES / "linreg.py"), "--hardware", "tpu"),
         "unknown hardware"),
        (("estimate", "step", str(EXAMPLES / "linreg.py"), "--gpus", "3"), "does not split"),
    ],
)
def test_estimate_step_mistakes_are_one_line(capsys, args, message):
    code, _, err = invoke(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_estimate_step_builds_on_real_tensors_when_the_script_needs_data(capsys, tmp_path):
    script = tmp_path / "numpy_data.py"
    script.write_text(DATA_DEPENDENT.replace(
        "    def loss(params, x):",
        "    table = torch.arange(8.0).numpy()  # a data pipeline: fails on fake tensors\n\n"
        "    def loss(params, x):"))
    result = as_json(capsys, "estimate", "step", str(script), "--set", "kind=plain")
    assert result["built_on"] == "real tensors" and not result["measured"]
    assert result["peak_bytes"] > 0


BATCHNORM_SCRIPT = """
import torch
from torch import nn
import minitrain as mt

CONFIG = {"batch_size": 16, "lr": 0.1}


def experiment(config):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Linear(8 * 7 * 7, 10))
    params, state, apply = mt.from_module(net, with_state=True)
    size = config["batch_size"]

    def loss(params, state, batch):
        x, y = batch
        logits, new_state = apply(params, state, x)
        return nn.functional.cross_entropy(logits, y), new_state

    def next_batch(g):
        return torch.randn(size, 3, 16, 16, generator=g), torch.randint(0, 10, (size,), generator=g)

    return mt.Experiment(init=lambda g: params, init_state=lambda g: state, loss=loss,
                         next_batch=next_batch, optimizer=mt.optim.sgd(lr=config["lr"],
                         momentum=0.9), steps=1)
"""


def test_estimate_step_of_a_model_with_batchnorm_state(capsys, tmp_path):
    script = tmp_path / "batchnorm.py"
    script.write_text(BATCHNORM_SCRIPT)
    predicted = as_json(capsys, "estimate", "step", str(script))
    measured = as_json(capsys, "estimate", "step", str(script), "--measure")
    assert predicted["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.02)
    assert predicted["flops"] == measured["flops"] and predicted["unknown_ops"] == {}
    assert predicted["memory"]["persistent"]["buffers"] > 0  # the running statistics
