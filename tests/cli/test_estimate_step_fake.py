"""``estimate step`` never builds a model for real by surprise: when ``init`` (or
``init_state``) cannot run on fake tensors, it says so in one line and offers ``--measure``."""

import json
import textwrap

import pytest

from minitrain.cli import main

SCRIPT = textwrap.dedent('''
    import torch
    import minitrain as mt

    CONFIG = {"dim": 4, "where": "init"}


    def experiment(config):
        dim = config["dim"]

        def init(generator):
            if config["where"] == "init":
                dim_now = int(torch.randint(1, 2, (), generator=generator)) * dim  # data-dependent
            else:
                dim_now = dim
            return {"w": torch.zeros(dim_now, 1)}

        def init_state(generator):
            return {"count": torch.zeros(int(torch.ones(()).sum()))}

        return mt.Experiment(
            init=init, loss=lambda p, x: (x @ p["w"]).square().mean(),
            next_batch=lambda g: torch.randn(8, dim, generator=g),
            optimizer=mt.optim.sgd(lr=0.1), steps=2,
            **({"init_state": init_state} if config["where"] == "init_state" else {}))
''')


def invoke(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.mark.parametrize("where", ["init", "init_state"])
def test_a_model_that_needs_data_to_build_is_refused_in_one_line(tmp_path, capsys, where):
    script = tmp_path / "needs_data.py"
    script.write_text(SCRIPT)
    code, _, err = invoke(capsys, "estimate", "step", str(script), "--set", f"where={where}",
                          "--set", "dim=1000000000000")
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{where} cannot run on fake tensors" in err and "--measure" in err


def test_measure_runs_the_same_script_for_real(tmp_path, capsys):
    script = tmp_path / "needs_data.py"
    script.write_text(SCRIPT)
    code, out, err = invoke(capsys, "estimate", "step", str(script), "--measure", "--json")
    assert code == 0, err
    assert json.loads(out)["measured"] and json.loads(out)["params"] == 4
