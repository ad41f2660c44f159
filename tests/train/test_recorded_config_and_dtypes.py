"""A CONFIG a checkpoint cannot record (or read back) and params whose dtype a backend would
change are refused before the first step, in one line naming the key or leaf (exit 2)."""

import json
import textwrap

import pytest
import torch

import minitrain as mt
from minitrain.checkpoint import _MAX_STATE_BYTES, STATE_FILE, list_checkpoints
from minitrain.cli import main
from minitrain.errors import ExperimentError
from minitrain.precision import Backend, Policy
from minitrain.train import Experiment, fit
from minitrain.train.experiment import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, load_script

SCRIPT = """
import torch
import minitrain as mt

{setup}
CONFIG = {config}


def experiment(config):
    init = lambda g: {{"w": torch.zeros(2), "b": torch.zeros((), dtype={dtype})}}  # noqa: E731
    return mt.Experiment(init=init, loss=lambda p, x: (x @ p["w"] + p["b"]).mean(),
                         next_batch=lambda g: torch.ones(4, 2),
                         optimizer=mt.optim.sgd(lr=config["lr"]), steps=3)
"""

DEEP = "deep = 0\nfor _ in range({}):\n    deep = [deep] if _ % 2 else {{'k': deep}}"

# setup code, CONFIG -> what the one error line says
CONFIGS = {
    "nested-3000": (DEEP.format(3000), "{'lr': 0.1, 'deep': deep}",
                    f"CONFIG['deep'] nests lists and dicts deeper than {MAX_CONFIG_DEPTH} levels"),
    "nested-101": (DEEP.format(MAX_CONFIG_DEPTH), "{'lr': 0.1, 'deep': [deep]}",
                   "CONFIG['deep'] nests lists and dicts deeper than"),
    "cycle": ("cycle = []\ncycle.append(cycle)", "{'lr': 0.1, 'cycle': cycle}",
              "CONFIG['cycle'] nests lists and dicts deeper than"),
    "65-MiB-string": ("", "{'lr': 0.1, 'text': 'x' * 65 * 2**20}",
                      "CONFIG takes 68157503 bytes as JSON, over the"),
    "over-the-limit": ("from minitrain.train.experiment import MAX_CONFIG_BYTES as M",
                       "{'lr': 0.1, 'text': 'é' * (M // 6 + 1)}", "bytes as JSON, over the"),
    "tuple-key": ("", "{(1, 2): 3, 'lr': 0.1}", "CONFIG has the key (1, 2)"),
    "int-key": ("", "{'lr': 0.1, 5: 'five'}", "CONFIG has the key 5"),
    "deep-tuple-key": ("key = ()\nfor _ in range(3000):\n    key = (key,)",
                       "{'lr': 0.1, key: 1}", "CONFIG has the key (((((((...),),),),),),)"),
    "huge-int": ("", "{'lr': 0.1, 'n': 10 ** 5000}", "CONFIG['n'] is an int outside"),
    "int-2**63": ("", "{'lr': 0.1, 'n': [2 ** 63]}", "CONFIG['n'][0] is an int outside"),
    "mappingproxy": ("import types", "{'lr': 0.1, 'm': types.MappingProxyType({})}",
                     "CONFIG['m'] is a mappingproxy"),
}


def cli_error(capsys, args):
    """The one ``error:`` line of a refused command (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--no-report"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize("case", CONFIGS)
@pytest.mark.parametrize("command", [["run"], ["sweep", "--set", "lr=0.1,0.2"]],
                         ids=["run", "sweep"])
def test_a_config_a_checkpoint_cannot_hold_is_one_line_naming_it(tmp_path, capsys, case,
                                                                 command):
    setup, config, shown = CONFIGS[case]
    path = tmp_path / "config.py"
    path.write_text(SCRIPT.format(setup=setup, config=config, dtype="torch.float32"))
    assert shown in cli_error(capsys, [command[0], str(path), *command[1:]])


def test_the_deepest_config_the_check_allows_is_read_back(tmp_path):
    path = tmp_path / "deep.py"
    path.write_text(SCRIPT.format(setup=DEEP.format(MAX_CONFIG_DEPTH),
                                  config="{'lr': 0.1, 'deep': deep}", dtype="torch.float32"))
    config, _ = load_script(path)
    assert mt.train.experiment.as_recorded(config) == config


def test_the_largest_config_the_check_allows_trains_checkpoints_and_resumes(tmp_path, capsys):
    """Whatever a run writes, its --resume reads back: a CONFIG of MAX_CONFIG_BYTES (in
    state.json as checkpoint.save writes it), 1 byte less than one the check refuses."""
    assert MAX_CONFIG_BYTES < _MAX_STATE_BYTES
    empty = len(json.dumps({"meta": {"config": {"lr": 0.1, "text": ""}}}, indent=1))
    path = tmp_path / "big.py"
    script = textwrap.dedent("""
        import torch
        import minitrain as mt

        CONFIG = {{"lr": 0.1, "text": "x" * {size}}}


        def experiment(config):
            return mt.Experiment(init=lambda g: {{"w": torch.zeros(2)}},
                                 loss=lambda p, x: (x @ p["w"] - 1).square().mean(),
                                 next_batch=lambda g: torch.randn(4, 2, generator=g),
                                 optimizer=mt.optim.sgd(lr=config["lr"]), steps=3)
    """)
    path.write_text(script.format(size=MAX_CONFIG_BYTES - empty + 1))
    with pytest.raises(ExperimentError, match="over the"):
        load_script(path)
    path.write_text(script.format(size=MAX_CONFIG_BYTES - empty))
    out = tmp_path / "run"
    args = ["run", str(path), "--out", str(out), "--checkpoint-every", "1", "--no-report"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--steps", "2"])
    first = capsys.readouterr()
    assert exit_info.value.code == 0, first.err
    state = list_checkpoints(out)[-1] / STATE_FILE
    assert MAX_CONFIG_BYTES < state.stat().st_size <= _MAX_STATE_BYTES
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--resume", "--json"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    assert "resuming from" in captured.err and "step 2" in captured.err
    assert json.loads(captured.out)["steps"] == 3


PARAM_SCRIPT = SCRIPT.format(setup="", config="{'lr': 0.1}", dtype="torch.{dtype}")


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
@pytest.mark.parametrize("command", [["run"], ["sweep", "--set", "lr=0.1,0.2"]],
                         ids=["run", "sweep"])
def test_params_the_backend_would_cast_are_one_line_naming_the_leaf(tmp_path, capsys, dtype,
                                                                    command):
    path = tmp_path / "dtype.py"
    path.write_text(PARAM_SCRIPT.replace("{dtype}", dtype))
    line = cli_error(capsys, [command[0], str(path), *command[1:]])
    assert f"torch.{dtype} tensor at 'b'" in line and "create the params as torch.float32" in line


def tiny(dtype=torch.float32):
    return Experiment(init=lambda g: {"w": torch.zeros(2, dtype=dtype)},
                      loss=lambda p, x: (x @ p["w"].float() - 1).square().mean(),
                      next_batch=lambda g: torch.ones(4, 2), optimizer=mt.optim.sgd(lr=0.1),
                      steps=1)


@pytest.mark.parametrize("name", [n for n in mt.available_backends() if n.startswith("cpu")])
def test_float32_params_train_on_every_backend(name):
    result = fit(tiny(), mt.get_backend(name), progress=False)
    assert result.params["w"].dtype == mt.get_backend(name).param_dtype
    assert result.summary["steps"] == 1


def test_params_in_the_backends_own_param_dtype_are_kept():
    pure_bf16 = Backend("pure-bf16", "cpu", Policy("bf16", "bf16", "bf16"))
    for dtype in (torch.bfloat16, torch.float32):
        assert fit(tiny(dtype), pure_bf16, progress=False).params["w"].dtype == torch.bfloat16
    with pytest.raises(ExperimentError, match="torch.float16 tensor at 'w'.*here torch.bfloat16"):
        fit(tiny(torch.float16), pure_bf16, progress=False)


SWEEP_SCRIPT = textwrap.dedent("""
    import torch
    import minitrain as mt

    CONFIG = {"lr": 0.1, "text": "x" * (20 * 2**20)}


    def experiment(config):
        return mt.Experiment(init=lambda g: {"w": torch.zeros(2)},
                             loss=lambda p, x: (x @ p["w"] - 1).square().mean(),
                             next_batch=lambda g: torch.randn(4, 2, generator=g),
                             optimizer=mt.optim.sgd(lr=config["lr"]), steps=3)
""")


def test_a_sweep_records_every_members_config_and_resumes_what_it_wrote(tmp_path, capsys):
    """A sweep's checkpoint holds each member's config: K × CONFIG must fit, and then resumes."""
    path = tmp_path / "sweep_big.py"
    path.write_text(SWEEP_SCRIPT)
    assert "CONFIG × 4 members" in cli_error(capsys, ["sweep", str(path), "--set",
                                                      "lr=0.1,0.2,0.3,0.4"])
    out = tmp_path / "sweep"
    args = ["sweep", str(path), "--set", "lr=0.1,0.2", "--out", str(out), "--checkpoint-every",
            "1", "--no-report", "--no-plot"]
    for more in (["--steps", "2"], ["--resume", "--json"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, *more])
        captured = capsys.readouterr()
        assert exit_info.value.code == 0, captured.err
    assert json.loads(captured.out)["steps"] == 3
