"""``minitrain estimate transformer --amsgrad/--momentum/--centered``: the optimizer state of a
preset against what torch.optim allocates, and the same flags, checks and messages as
``minitrain estimate memory``."""

import json

import pytest
import torch

from minitrain import accounting as acc
from minitrain.cli import main
from minitrain.cli.estimate import estimate
from tests.references import TORCH_REFERENCED

FLAGS = ("amsgrad", "momentum", "centered")
NAMES = TORCH_REFERENCED
TAKERS = {"amsgrad": ("adam", "adamw"), "momentum": ("sgd", "momentum", "rmsprop"),
          "centered": ("rmsprop",)}
# (--optimizer, flags, torch.optim class, its keyword arguments)
TORCH_CASES = [
    ("adam", ("--amsgrad",), "Adam", dict(amsgrad=True)),
    ("adamw", ("--amsgrad",), "AdamW", dict(amsgrad=True)),
    ("sgd", ("--momentum",), "SGD", dict(lr=0.1, momentum=0.9)),
    ("momentum", ("--momentum",), "SGD", dict(lr=0.1, momentum=0.9)),
    ("rmsprop", ("--momentum",), "RMSprop", dict(momentum=0.9)),
    ("rmsprop", ("--centered",), "RMSprop", dict(centered=True)),
    ("rmsprop", ("--momentum", "--centered"), "RMSprop", dict(momentum=0.9, centered=True)),
    # without a flag (guards: these were right before)
    ("adam", (), "Adam", {}),
    ("sgd", (), "SGD", dict(lr=0.1)),
    ("momentum", (), "SGD", dict(lr=0.1, momentum=0.9)),
    ("rmsprop", (), "RMSprop", {}),
]
# precision -> the dtype torch.optim keeps the state in (fp32 master weights and state for
# bf16-mixed; autocast over fp32 params for bf16; everything bf16 for bf16-pure)
STATE_DTYPES = {"fp32": torch.float32, "bf16-mixed": torch.float32, "bf16": torch.float32,
                "bf16-pure": torch.bfloat16}
GPT2_PARAMS = 124_439_808


def invoke(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def transformer_json(capsys, *args):
    code, out, err = invoke(capsys, "estimate", "transformer", "--preset", "gpt2", *args,
                            "--json")
    assert code == 0, err
    return json.loads(out)


def torch_state_bytes_per_param(cls_name, options, dtype):
    """Bytes of parameter-sized state per parameter element that ``torch.optim.<cls_name>``
    allocates in one step of a small model (its 0-d ``step`` counters, O(1) per tensor, aside)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                                torch.nn.Linear(16, 3)).to(dtype)
    params = list(model.parameters())
    optimizer = getattr(torch.optim, cls_name)(params, **options)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    state_bytes = 0
    for p in params:
        for t in optimizer.state[p].values():
            if not isinstance(t, torch.Tensor):
                continue
            assert t.shape == p.shape or t.dim() == 0, (cls_name, t.shape)
            state_bytes += t.nbytes if t.shape == p.shape else 0
    return state_bytes / sum(p.numel() for p in params)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp32", "bf16-pure"])
@pytest.mark.parametrize(("name", "flags", "cls_name", "options"), TORCH_CASES,
                         ids=[f"{n}{''.join(f)}" for n, f, _, _ in TORCH_CASES])
def test_state_bytes_equal_torch_optims_scaled_to_the_preset(capsys, name, flags, cls_name,
                                                             options, precision):
    per_param = torch_state_bytes_per_param(cls_name, options, STATE_DTYPES[precision])
    result = transformer_json(capsys, "--optimizer", name, *flags, "--precision", precision)
    assert result["params"] == GPT2_PARAMS
    assert result["memory_per_gpu"]["optimizer_state"] == per_param * GPT2_PARAMS
    memory = result["memory_per_gpu"]
    assert memory["total"] == pytest.approx(sum(v for k, v in memory.items() if k != "total"))


@pytest.mark.parametrize(("name", "flags"), [
    ("adamw", ()), ("Adam", ("--amsgrad",)), ("rmsprop", ("--centered", "--momentum")),
])
def test_the_json_names_the_optimizer_and_its_state_options(capsys, name, flags):
    result = transformer_json(capsys, "--optimizer", name, *flags)
    assert result["optimizer"] == name.lower()
    assert result["state_options"] == {flag: f"--{flag}" in flags for flag in FLAGS}


@pytest.mark.parametrize(("name", "flags", "cls_name", "options"), TORCH_CASES[:7],
                         ids=[f"{n}{''.join(f)}" for n, f, _, _ in TORCH_CASES[:7]])
def test_state_bytes_are_sharded_by_zero_stage_1(capsys, name, flags, cls_name, options):
    per_param = torch_state_bytes_per_param(cls_name, options, torch.float32)
    result = transformer_json(capsys, "--optimizer", name, *flags, "--gpus", "8", "--zero", "1")
    assert result["memory_per_gpu"]["optimizer_state"] == pytest.approx(
        per_param * GPT2_PARAMS / 8)
    assert result["memory_per_gpu"]["master_weights"] == pytest.approx(4 * GPT2_PARAMS / 8)


VALID = [(name, flags) for name in NAMES
         for flags in [(), *[(f,) for f in FLAGS if name in TAKERS[f]]]] + [
    ("rmsprop", ("momentum", "centered"))]


@pytest.mark.parametrize(("name", "flags"), VALID,
                         ids=[f"{n}-{'-'.join(f) or 'default'}" for n, f in VALID])
def test_state_bytes_agree_with_estimate_memory(capsys, name, flags):
    args = ("--optimizer", name, *(f"--{f}" for f in flags), "--precision", "bf16-mixed")
    result = transformer_json(capsys, *args)
    code, out, err = invoke(capsys, "estimate", "memory", *args, "--json")
    assert code == 0, err
    per_param = json.loads(out)["bytes_per_param"]
    memory = result["memory_per_gpu"]
    if name in ("adafactor", "muon"):  # counted tensor by tensor: factored moments, or Muon for
        # the layers' matrices and AdamW for the rest (test_transformer_state_by_tensor.py)
        elements = acc.transformer_optimizer_state_elements(acc.preset("gpt2"), name)
        assert memory["optimizer_state"] == 4 * elements
    else:
        assert memory["optimizer_state"] == per_param["optimizer_state"] * GPT2_PARAMS
    assert memory["master_weights"] == per_param["master_weights"] * GPT2_PARAMS


def test_the_report_names_the_variant_and_its_state_bytes(capsys):
    code, out, err = invoke(capsys, "estimate", "transformer", "--preset", "gpt2",
                            "--optimizer", "adam", "--amsgrad")
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("memory per GPU"))
    # 3 fp32 tensors per param: 12 × 124,439,808 = 1.493 GB; the fp32 master copy beside
    assert "optimizer state (adam+amsgrad) 1.493 GB, master weights 497.8 MB" in line
    code, out, err = invoke(capsys, "estimate", "transformer", "--preset", "gpt2",
                            "--optimizer", "RMSprop", "--momentum", "--centered",
                            "--precision", "fp32")
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("memory per GPU"))
    assert "optimizer state (rmsprop+momentum+centered) 1.493 GB, activations" in line


REFUSED = [(name, flag) for flag in FLAGS for name in NAMES if name not in TAKERS[flag]]


@pytest.mark.parametrize(("name", "flag"), REFUSED, ids=[f"{n}-{f}" for n, f in REFUSED])
def test_a_flag_the_optimizer_does_not_take_is_refused_as_estimate_memory_does(capsys, name,
                                                                               flag):
    code, out, err = invoke(capsys, "estimate", "transformer", "--preset", "gpt2",
                            "--optimizer", name, f"--{flag}")
    assert code == 2 and not out
    assert f"{flag} does not apply to {name}" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    memory_code, _, memory_err = invoke(capsys, "estimate", "memory", "--optimizer", name,
                                        f"--{flag}")
    assert (memory_code, memory_err) == (code, err)


@pytest.mark.parametrize("command", ["memory", "transformer"])
def test_an_unknown_optimizer_with_a_flag_is_one_line(capsys, command):
    preset = ("--preset", "gpt2") if command == "transformer" else ()
    code, out, err = invoke(capsys, "estimate", command, *preset, "--optimizer", "lambda",
                            "--amsgrad")
    assert code == 2 and not out
    assert "unknown optimizer 'lambda'" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_flags_have_the_same_help_and_kind_in_both_commands(capsys):
    def options(command):
        return {p.name: (p.help, p.is_flag, p.default) for p in estimate.commands[command].params
                if p.name in ("optimizer", *FLAGS)}

    assert options("transformer") == options("memory")
    assert set(options("transformer")) == {"optimizer", *FLAGS}
    code, out, _ = invoke(capsys, "estimate", "transformer", "--help")
    assert code == 0
    for flag in FLAGS:
        assert f"--{flag}" in out
    assert "Centered RMSprop: one more state tensor." in out


def test_transformer_memory_takes_the_state_options():
    config = acc.preset("gpt2")
    plain = acc.transformer_memory(config, batch=1, optimizer="adam", precision_name="fp32")
    amsgrad = acc.transformer_memory(config, batch=1, optimizer="adam", precision_name="fp32",
                                     amsgrad=True)
    assert amsgrad.optimizer_state == plain.optimizer_state * 3 / 2
    assert amsgrad._replace(optimizer_state=0) == plain._replace(optimizer_state=0)
    with pytest.raises(ValueError, match="centered does not apply to adam"):
        acc.transformer_memory(config, batch=1, optimizer="adam", centered=True)
    memory = acc.training_memory(10, optimizer="rmsprop", precision="fp32", momentum=True,
                                 centered=True)
    assert memory.optimizer_state == 10 * 3 * 4
