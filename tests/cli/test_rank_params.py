"""Under ``--nproc``, ranks whose params differ after init (values, shapes) are refused before the
first step: one ``error:`` line naming the leaf, exit 2, no traceback."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os, torch, minitrain as mt

    CONFIG = {"differ": "value"}


    def experiment(config):
        rank = int(os.environ.get("RANK", "0"))

        def init(generator):
            w = torch.zeros(2 + rank) if config["differ"] == "shape" else torch.full((2,), rank)
            return {"b": torch.zeros(()), "w": w.float()}

        def next_batch(generator):
            if os.environ.get("RANK"):
                raise AssertionError("a step ran")
            return torch.randn(4, 2, generator=generator)

        return mt.Experiment(
            init=init, loss=lambda p, x: (x @ p["w"][:2] + p["b"]).square().mean(),
            next_batch=next_batch, optimizer=mt.optim.sgd(lr=0.1), steps=2)
''')


@pytest.mark.parametrize("differ, shown", [
    ("value", "different values at 'w'"),
    ("shape", "rank 0 'w' of shape (2,) and torch.float32 but rank 1 'w' of shape (3,)"),
])
def test_ranks_whose_params_differ_are_one_line_naming_the_leaf(tmp_path, differ, shown):
    script = tmp_path / "ranks.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "MINITRAIN_DIST_TIMEOUT": "60"}
    result = subprocess.run(
        [sys.executable, "-m", "minitrain", "run", str(script), "--nproc", "2", "--no-report",
         "--set", f"differ={differ}", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and shown in errors[0], result.stderr
    assert "Traceback" not in result.stderr and "a step ran" not in result.stderr
