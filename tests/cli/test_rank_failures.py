"""Under ``--nproc``, the first rank that fails on its own is the error the user sees: the
script's frames and one ``error: rank N: ...`` line, at once (the other ranks are not left
waiting in a collective), and once, however many ranks fail alike."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os, torch, minitrain as mt

    CONFIG = {"steps": 8, "failing": "1"}


    def experiment(config):
        calls = {"n": 0}

        def next_batch(generator):
            calls["n"] += 1
            if calls["n"] == 5 and os.environ["RANK"] in config["failing"].split("+"):
                raise ValueError(f"bad shard 17 on rank {os.environ['RANK']}")
            return torch.randn(4, 2, generator=generator)

        return mt.Experiment(
            init=lambda g: {"w": torch.zeros(2)},
            loss=lambda p, x: (x @ p["w"] - 1).square().mean(), next_batch=next_batch,
            optimizer=mt.optim.sgd(lr=0.1), steps=config["steps"])
''')


@pytest.mark.parametrize("failing", ["1", "0+1"])
def test_the_first_failing_rank_is_the_error_shown(tmp_path, failing):
    script = tmp_path / "fails.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MINITRAIN_DIST_TIMEOUT": "60"}
    result = subprocess.run(
        [sys.executable, "-m", "minitrain", "run", str(script), "--nproc", "2",
         "--set", f"failing={failing}", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    rank = errors[0].removeprefix("error: rank ").split(":")[0]
    assert rank in failing.split("+")
    assert f"ValueError: bad shard 17 on rank {rank}" in errors[0]
    assert "Traceback of your code" in result.stderr and 'in next_batch' in result.stderr
    assert "Traceback (most recent call last)" not in result.stderr
