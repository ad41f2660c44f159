"""A corpus of user mistakes: each gives one line ``error: ...``, exit code 2, no traceback, and
leaves every existing checkpoint byte for byte as it was."""

import hashlib
from pathlib import Path

import pytest
import torch

from minitrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
LINREG = str(ROOT / "examples" / "linreg.py")
BYTELM = str(ROOT / "examples" / "bytelm.py")

SCRIPTS = {
    "no_entry.py": "CONFIG = {'lr': 0.1}\n",
    "syntax.py": "CONFIG = {\n",
    "config_list.py": "CONFIG = [1]\ndef experiment(config):\n    return None\n",
    "wrong_return.py": "CONFIG = {}\ndef experiment(config):\n    return {'init': None}\n",
    "notes.txt": "not python\n",
    "shape_bug.py": (
        "import torch, minitrain as mt\n"
        "CONFIG = {'steps': 3}\n"
        "def experiment(config):\n"
        "    return mt.Experiment(\n"
        "        init=lambda g: mt.models.cruncher_init(dim=8, num_layers=1, generator=g),\n"
        "        loss=lambda p, x: mt.models.cruncher(p, x).mean(),\n"
        "        next_batch=lambda g: torch.randn(4, 7, generator=g),\n"
        "        optimizer=mt.optim.sgd(lr=0.1), steps=config['steps'])\n"
    ),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Bad scripts, a file where a directory belongs, and a finished run with checkpoints."""
    root = tmp_path_factory.mktemp("bad")
    for name, text in SCRIPTS.items():
        (root / name).write_text(text)
    (root / "a_file").write_text("x")
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "not_prepared").mkdir()
    (root / "not_prepared" / "stray.txt").write_text("x")
    (root / "no_metrics").mkdir()
    run = root / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "run",
                LINREG,
                "--steps",
                "20",
                "--checkpoint-every",
                "10",
                "--out",
                str(run),
                "--json",
                "--no-report",
            ]
        )
    assert exit_info.value.code == 0
    return root


def fingerprint(run: Path) -> dict[str, str]:
    return {
        str(path.relative_to(run)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted((run / "checkpoints").rglob("*"))
        if path.is_file()
    }


def cases(cuda_present: bool) -> list[tuple[str, list[str], str]]:
    """(id, argv, text the one-line message must contain)."""
    run = ["run", LINREG]
    listed = [
        # The command line.
        ("unknown-flag", [*run, "--fast"], "No such option '--fast'"),
        ("unknown-command", ["trian"], "No such command"),
        ("missing-script", ["run", "examples/nope.py"], "no such experiment script"),
        ("script-is-dir", ["run", "{root}"], "is not a Python file"),
        ("script-not-python", ["run", "{root}/notes.txt"], "is not a Python file"),
        ("steps-negative", [*run, "--steps", "-1"], "--steps"),
        ("seed-negative", [*run, "--seed", "-5"], "--seed"),
        ("steps-not-int", [*run, "--steps", "ten"], "--steps"),
        ("unknown-backend", [*run, "--backend", "tpu"], "installed backends: cpu"),
        ("keep-zero", [*run, "--keep", "0", "--out", "{root}/k"], "--keep"),
        ("out-is-file", [*run, "--out", "{root}/a_file"], "is a file, not a directory"),
        ("out-dangling-link", [*run, "--out", "{root}/dangling"], "which does not exist"),
        ("resume-without-out", [*run, "--resume"], "pass --out DIR"),
        ("checkpoint-without-out", [*run, "--checkpoint-every", "5"], "pass --out DIR"),
        # The experiment script and its config.
        ("no-entry-point", ["run", "{root}/no_entry.py"], "has no experiment(config) function"),
        ("syntax-error", ["run", "{root}/syntax.py"], "failed to import: SyntaxError"),
        ("config-not-dict", ["run", "{root}/config_list.py"], "CONFIG must be a dict"),
        ("wrong-return", ["run", "{root}/wrong_return.py"], "must return a minitrain.Experiment"),
        ("unknown-key", [*run, "--set", "lrr=0.1"], "unknown config key 'lrr'"),
        ("float-expected", [*run, "--set", "lr=fast"], "expected a float"),
        ("int-expected", [*run, "--set", "dim=2.5"], "expected an int"),
        ("no-equals", [*run, "--set", "lr"], "--set expects key=value"),
        ("negative-lr", [*run, "--set", "lr=-0.1"], "lr"),
        ("zero-dim", [*run, "--set", "dim=0"], "dim must be"),
        ("shape-bug-in-loss", ["run", "{root}/shape_bug.py"], "shape mismatch"),
        ("heads-do-not-divide", ["run", BYTELM, "--set", "n_heads=3"], "divisible by n_heads"),
        # Data files.
        (
            "data-dir-not-prepared",
            ["run", BYTELM, "--set", "data_dir={root}/not_prepared"],
            "holds no prepared data",
        ),
        ("plot-without-metrics", ["plot", "{root}/no_metrics"], "metrics.jsonl"),
        # Checkpoints: resuming someone else's run.
        ("resume-other-lr", [*run, "--set", "lr=0.1", "--out", "{root}/run", "--resume"], "lr"),
        ("resume-other-seed", [*run, "--seed", "9", "--out", "{root}/run", "--resume"], "seed"),
        ("resume-past-steps", [*run, "--steps", "5", "--out", "{root}/run", "--resume"], "past"),
        (
            "resume-other-backend",
            [*run, "--backend", "cpu-bf16", "--out", "{root}/run", "--resume"],
            "backend",
        ),
    ]
    if not cuda_present:
        listed.append(("cuda-without-gpu", [*run, "--backend", "cuda"], "no CUDA GPU"))
    return listed


CASES = cases(torch.cuda.is_available())


def test_corpus_is_large():
    assert len(CASES) >= 25


@pytest.mark.parametrize(("argv", "needle"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_mistake_gives_one_line_exit_2_and_keeps_checkpoints(workspace, capsys, argv, needle):
    before = fingerprint(workspace / "run")
    argv = [arg.format(root=workspace) for arg in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    lines = captured.err.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], captured.err  # progress may come first
    assert needle in errors[0], errors[0]
    assert "Traceback" not in captured.out + captured.err
    assert fingerprint(workspace / "run") == before
