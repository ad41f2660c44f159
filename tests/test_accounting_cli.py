"""``minitrain estimate`` and ``minitrain hardware``: the chapter's scenarios from the shell."""

import json

import pytest

from minitrain.cli import main


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
        (("estimate", "time", "--params", "lots", "--tokens", "1"), "not a number"),
        (("estimate", "time", "--params", "1", "--tokens", "1", "--hardware", "tpu"),
         "unknown hardware"),
        (("estimate", "time", "--params", "1", "--tokens", "1", "--dtype", "fp5"),
         "unknown dtype"),
        (("estimate", "memory", "--optimizer", "lion"), "unknown optimizer"),
        (("estimate", "transformer", "--preset", "gpt9"), "unknown preset"),
        (("hardware", "abacus"), "unknown hardware"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(capsys, args, message):
    code, _, err = invoke(capsys, *args)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
