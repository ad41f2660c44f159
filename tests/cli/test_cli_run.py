"""``minitrain run`` end to end: the chapter's learning-rate point, reproducibility, exit codes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minitrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
LINREG = str(ROOT / "examples" / "linreg.py")


def invoke(capsys, *args):
    """Run the CLI in-process; return (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def run_json(capsys, *args):
    code, out, err = invoke(capsys, "run", LINREG, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def test_defaults_reach_low_loss(capsys):
    summary = run_json(capsys)
    assert summary["steps"] == 1000
    assert summary["final_loss"] < 1e-3
    assert summary["params"] == 16
    assert summary["flops_per_step"] == 6 * 4 * 16  # 6·B·P
    for key in ("final_loss", "steps", "params", "flops_per_step", "seconds"):
        assert key in summary


def test_learning_rate_point_from_the_chapter(capsys):
    fast = run_json(capsys, "--set", "lr=0.1", "--steps", "300")
    assert fast["final_loss"] < 1e-6
    slow = run_json(capsys, "--set", "lr=0.01", "--steps", "10")
    assert slow["final_loss"] > 100 * max(fast["final_loss"], 1e-12)
    assert slow["final_loss"] > 1.0


def test_same_seed_same_losses_at_every_step(capsys, tmp_path):
    for name in ("a", "b", "c"):
        seed = "3" if name != "c" else "4"
        run_json(capsys, "--steps", "50", "--seed", seed, "--out", str(tmp_path / name))

    def losses(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    assert len(losses("a")) == 50
    assert losses("a") == losses("b")
    assert losses("a") != losses("c")
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert summary["steps"] == 50 and summary["config"]["lr"] == 0.01


def test_human_summary_and_progress(capsys):
    code, out, err = invoke(capsys, "run", LINREG, "--steps", "20")
    assert code == 0
    for word in ("final loss", "wall time", "params", "FLOPs / step"):
        assert word in out


def test_cpu_bf16_backend_trains(capsys):
    summary = run_json(capsys, "--backend", "cpu-bf16", "--set", "lr=0.1", "--steps", "200")
    assert summary["backend"] == "cpu-bf16"
    # From ~1e3 at init; bf16 keeps ~3 significant digits of y (values up to ~50).
    assert summary["final_loss"] < 0.1


BAD_SCRIPT_NO_ENTRY = "CONFIG = {'lr': 0.1}\n"
BAD_SCRIPT_IMPORT = "import torch\nCONFIG = {}\nraise RuntimeError('boom')\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", LINREG, "--no-such-flag"], "No such option"),
        (["run", "examples/missing.py"], "no such experiment script"),
        (["run", "{no_entry}"], "has no experiment(config) function"),
        (["run", "{bad_import}"], "failed to import: RuntimeError: boom (line 3)"),
        (["run", LINREG, "--set", "lrr=0.1"], "unknown config key 'lrr'"),
        (["run", LINREG, "--set", "lr=fast"], "expected a float"),
        (["run", LINREG, "--set", "dim=1.5"], "expected an int"),
        (["run", LINREG, "--set", "lr"], "--set expects key=value"),
        (["run", LINREG, "--steps", "-3"], "--steps"),
        (["run", LINREG, "--backend", "tpu"], "unknown backend 'tpu'"),
        (["run", "{a_dir}"], "is not a Python file"),
        (["no-such-command"], "No such command"),
    ],
)
def test_user_mistakes_exit_2_with_one_line(capsys, tmp_path, args, message):
    (tmp_path / "no_entry.py").write_text(BAD_SCRIPT_NO_ENTRY)
    (tmp_path / "bad_import.py").write_text(BAD_SCRIPT_IMPORT)
    paths = {
        "no_entry": tmp_path / "no_entry.py",
        "bad_import": tmp_path / "bad_import.py",
        "a_dir": tmp_path,
    }
    args = [a.format(**paths) for a in args]
    code, out, err = invoke(capsys, *args)
    assert code == 2
    assert message in err
    assert err.startswith("error: ")
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err + out


def test_cuda_without_gpu_exits_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, _, err = invoke(capsys, "run", LINREG, "--backend", "cuda")
    assert code == 2 and "no CUDA GPU" in err and len(err.strip().splitlines()) == 1


def test_diverging_run_exits_1(capsys):
    code, _, err = invoke(capsys, "run", LINREG, "--set", "lr=5", "--steps", "500")
    assert code == 1 and "loss became" in err and "Traceback" not in err


def test_backends_command(capsys):
    code, out, _ = invoke(capsys, "backends", "--json")
    rows = {row["name"]: row for row in json.loads(out)}
    assert code == 0 and rows["cpu"]["usable"] and {"cpu-bf16", "cuda"} <= set(rows)


def test_console_script_and_module_entry_points(tmp_path):
    good = subprocess.run(["minitrain", "run", LINREG, "--steps", "5", "--json"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert good.returncode == 0, good.stderr
    assert json.loads(good.stdout)["steps"] == 5
    bad = subprocess.run([sys.executable, "-m", "minitrain", "run", LINREG, "--set", "nope=1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_compile_trains_the_same_losses(tmp_path, capsys):
    # The compiled run in a fresh interpreter: under pytest the jaxtyping import hook wraps
    # every function in checks that dynamo cannot trace. --compile compiles forward and
    # backward; the update stays eager (and donates), so the losses match an eager run.
    args = ["run", LINREG, "--steps", "30", "--no-report", "--json"]
    code, _, err = invoke(capsys, *args, "--out", str(tmp_path / "eager"))
    assert code == 0, err
    result = subprocess.run(
        [sys.executable, "-m", "minitrain", *args, "--out", str(tmp_path / "compiled"),
         "--compile"], capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    eager, compiled = (
        [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text()
         .splitlines()]
        for run in ("eager", "compiled")
    )
    assert len(compiled) == 30
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-6)
