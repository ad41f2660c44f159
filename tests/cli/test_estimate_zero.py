"""``minitrain estimate memory --params N ...`` against DeepSpeed's own estimators, through the
command line: every ZeRO flag reaches ``accounting.zero_memory`` and the figures printed are
DeepSpeed's (``estimate_zero2/3_model_states_mem_needs``), bf16 params with fp32 Adam state."""

import importlib.util
import itertools
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from minitrain.cli import cli, main
from tests.accounting.test_zero_deepspeed import _DEEPSPEED, close

N, LAYER = 6_738_415_616, 202_383_360  # Llama 2 7B and its embedding
ZERO2 = [(N, g, nodes, offload, 1.5)
         for g, nodes, offload in itertools.product([1, 8], [1], [False, True])]
ZERO3 = [(N, LAYER, g, nodes, opt, par, init, 1.5)
         for g, nodes, (opt, par), init in itertools.product(
             [1, 8], [1, 2], [(False, False), (True, False), (True, True)], [True, False])]


@pytest.fixture(scope="module")
def deepspeed():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.fail("deepspeed is the reference this test compares with and is not installed; "
                    "install the test extras: pip install -e '.[test]'", pytrace=False)
    calls = {"zero2": ZERO2, "zero3": ZERO3}
    run = subprocess.run([sys.executable, "-c", _DEEPSPEED], input=json.dumps(calls),
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def estimate(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["estimate", "memory", "--precision", "bf16-mixed",
                                      "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["zero"]


def test_stage_2_flags_match_deepspeed(deepspeed):
    for (n, g, nodes, offload, b), (cpu, gpu) in zip(ZERO2, deepspeed["zero2"], strict=True):
        ours = estimate("--zero", "2", "--params", str(n), "--gpus", str(g), "--nodes",
                        str(nodes), "--buffer-factor", str(b),
                        *(["--offload", "optimizer"] if offload else []))
        assert close(ours["gpu"], gpu) and close(ours["cpu"], cpu), (g, offload, ours)


def test_stage_3_flags_match_deepspeed(deepspeed):
    for (n, layer, g, nodes, opt, par, init, b), (cpu, gpu, gathered) in zip(
            ZERO3, deepspeed["zero3"], strict=True):
        offload = [*(["--offload", "optimizer"] if opt else []),
                   *(["--offload", "params"] if par else [])]
        ours = estimate("--zero", "3", "--params", str(n), "--largest-layer", str(layer),
                        "--gpus", str(g), "--nodes", str(nodes), "--buffer-factor", str(b),
                        "--zero-init" if init else "--no-zero-init", *offload)
        assert close(ours["gpu"], gpu) and close(ours["gathered"], gathered), (g, nodes, ours)
        if not (opt and nodes > 1) and not (init and opt):
            # the CPU figures differ on purpose there: see tests/accounting/test_zero_deepspeed.py
            assert close(ours["cpu"], cpu), (g, nodes, opt, par, init, ours, cpu)


@pytest.mark.parametrize("args, says", [
    (["--params", "7e9"], "--largest-layer"),
    (["--params", "7e9", "--zero", "0"], "--zero 1, 2 or 3"),
    (["--params", "7e9", "--zero", "2", "--offload", "params"], "--offload params needs --zero 3"),
    (["--params", "7e9", "--largest-layer", "8e9"], "more than --params"),
    (["--params", "inf", "--largest-layer", "1"], "number"),
    (["--params", "7e9", "--largest-layer", "1", "--buffer-factor", "0"], "x>0"),
])
def test_a_bad_zero_flag_is_one_line(args, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "memory", *args])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert says in err and err.startswith("error: ") and "\n" not in err, err
