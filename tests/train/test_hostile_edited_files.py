"""Hostile inputs: files of a run or of a prepared corpus edited by hand, then used.

A checkpoint whose ``state.json`` still matches its checksum but holds a missing field, a
wrong type or a garbage RNG state is skipped like a corrupt one: ``--resume`` says which and
why and continues from the previous checkpoint (exit 0), never a traceback. A damaged corpus
is an ``error:`` line naming the file (exit 2), never rebuilt from another source.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from test_checkpoint import STATE_EDITS, edit_state
from test_hostile_harness import (
    check_clean,
    check_kept,
    invoke,
    latest_step,
    main,
    run,
    snapshot,
    steps_logged,
)

from minitrain import data
from tests.references import require

CKPT = "checkpoints/step-{:08d}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 6-step run with checkpoints at steps 2, 4 and 6 (and its script)."""
    from test_hostile_harness import SCRIPT

    root = tmp_path_factory.mktemp("trained")
    (root / "hostile_script.py").write_text(SCRIPT)
    args = ["run", root / "hostile_script.py", "--json", "--no-report", "--steps", "6",
            "--out", root / "run", "--checkpoint-every", "2", "--keep", "10"]
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    assert exit_info.value.code == 0
    return root


@pytest.fixture
def used(trained, tmp_path):
    """A copy of the trained run: (script, run directory)."""
    shutil.copy(trained / "hostile_script.py", tmp_path / "hostile_script.py")
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "hostile_script.py", tmp_path / "run"


def damage_file(name, how):
    def damage(out, step=6):
        path = out / CKPT.format(step) / name
        if how == "truncate":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif how == "flip":
            content = bytearray(path.read_bytes())
            content[len(content) // 2] ^= 0xFF
            path.write_bytes(bytes(content))
        elif how == "empty":
            path.write_bytes(b"")
        elif how == "delete":
            path.unlink()
        elif how == "garbage":
            path.write_bytes(b"\x00garbage{")
        elif how == "pickle":
            path.write_bytes(pickle.dumps({"step": 6}))

    return damage


def whole_dir_is_a_file(out):
    shutil.rmtree(out / CKPT.format(6))
    (out / CKPT.format(6)).write_text("not a checkpoint")


# id: (damage of checkpoint step 6, words the skip message holds)
SKIPS = {
    **{
        f"state.json {name}": (
            lambda out, edit=edit: edit_state(out / CKPT.format(6), edit), message
        )
        for name, (edit, message) in STATE_EDITS.items()
    },
    "params truncated": (damage_file("params.safetensors", "truncate"), "truncated"),
    "opt_state truncated": (damage_file("opt_state.safetensors", "truncate"), "truncated"),
    "params flipped byte": (damage_file("params.safetensors", "flip"), "SHA-256"),
    "params empty": (damage_file("params.safetensors", "empty"), "0 bytes"),
    "params deleted": (damage_file("params.safetensors", "delete"), "missing"),
    "state.json deleted": (damage_file("state.json", "delete"), "no state.json"),
    "state.json garbage": (damage_file("state.json", "garbage"), "not valid JSON"),
    "state.json a pickle": (damage_file("state.json", "pickle"), "pickle"),
    "state.json truncated": (damage_file("state.json", "truncate"), "not valid JSON"),
    "checkpoint is a file": (whole_dir_is_a_file, "not a directory"),
}


def run_skip_case(capsys, used, damage, words):
    script_path, out = used
    kept = {k: v for k, v in snapshot(out).items() if not k.startswith(CKPT.format(6))}
    damage(out)
    code, stdout, err = run(capsys, script_path, out, "--resume", "--keep", "10", steps=8)
    assert code == 0, err
    check_clean(err, script=script_path, error=False)
    skip = [line for line in err.splitlines() if "skipping checkpoint step-00000006" in line]
    assert len(skip) == 1 and words in skip[0], err
    assert "resuming from" in err and "step-00000004" in err, err
    check_kept({k: v for k, v in kept.items() if k != "metrics.jsonl"}, out)
    assert steps_logged(out) == list(range(1, 9))
    assert latest_step(out) == 8


@pytest.mark.parametrize("case", sorted(SKIPS))
def test_a_damaged_checkpoint_is_skipped_on_resume(capsys, used, case):
    run_skip_case(capsys, used, *SKIPS[case])


def _both_newest_damaged(out):
    for step in (4, 6):
        damage_file("params.safetensors", "truncate")(out, step)


def _copy_as(name, step=6):
    def copy(out):
        shutil.copytree(out / CKPT.format(step), out / "checkpoints" / name)

    return copy


def _swap(name, source=4):
    def swap(out):
        shutil.copy(out / CKPT.format(source) / name, out / CKPT.format(6) / name)

    return swap


def _torch_save_over(out):
    import torch

    torch.save({"w": torch.zeros(4)}, out / CKPT.format(6) / "params.safetensors")


def _stray_file(out):
    (out / CKPT.format(6) / "notes.txt").write_text("mine")


def _dead_staging(out):
    (out / "checkpoints" / ".tmp-999999999-step-00000008-x").mkdir()
    (out / "checkpoints" / ".tmp-999999999-step-00000008-x" / "state.json").write_text("{")


# id: (damage, the skip messages expected (step: words), the step resumed from)
ODD_LAYOUTS = {
    "the two newest truncated": (
        _both_newest_damaged, {6: "truncated", 4: "truncated"}, 2),
    "state.json of step 4 under step 6": (_swap("state.json"), {6: "records step 4"}, 4),
    "params of step 4 under step 6": (_swap("params.safetensors"), {6: "SHA-256"}, 4),
    "params written by torch.save": (_torch_save_over, {6: "torch.save format"}, 4),
    "a copy of step 6 named step 9": (_copy_as("step-00000009"), {9: "records step 6"}, 6),
    "a name with a leading zero too many": (_copy_as("step-000000009"), {}, 6),
    "a name past 19 digits": (_copy_as("step-" + "9" * 20), {}, 6),
    "a stray file in a checkpoint": (_stray_file, {}, 6),
    "staging left by a dead process": (_dead_staging, {}, 6),
}


@pytest.mark.parametrize("case", sorted(ODD_LAYOUTS))
def test_odd_checkpoint_layouts_on_resume(capsys, used, case):
    damage, skips, start = ODD_LAYOUTS[case]
    script_path, out = used
    untouched = {k: v for k, v in snapshot(out).items()
                 if k.startswith("checkpoints/") and int(k.split("/")[1][5:]) < start}
    damage(out)
    code, stdout, err = run(capsys, script_path, out, "--resume", "--keep", "10", steps=8)
    assert code == 0, err
    check_clean(err, script=script_path, error=False)
    skipped = [line for line in err.splitlines() if line.startswith("skipping checkpoint")]
    assert len(skipped) == len(skips), err
    for step, words in skips.items():
        assert any(f"step-{step:08d}" in line and words in line for line in skipped), err
    assert f"step-{start:08d} (step {start})" in err, err
    check_kept(untouched, out)
    assert steps_logged(out) == list(range(1, 9)) and latest_step(out) == 8
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_an_unreadable_checkpoint_is_skipped_on_resume(capsys, used, monkeypatch):
    script_path, out = used
    newest = out / CKPT.format(6)
    real_read = Path.read_bytes

    def read_bytes(self):
        if self.parent == newest:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, stdout, err = run(capsys, script_path, out, "--resume", "--keep", "10", steps=8)
    monkeypatch.undo()
    assert code == 0, err
    check_clean(err, script=script_path, error=False)
    assert "skipping checkpoint step-00000006" in err and "permission denied" in err, err
    assert steps_logged(out) == list(range(1, 9))


@pytest.mark.parametrize("damaged", [False, True], ids=["newest good", "newest corrupt"])
def test_resume_reads_each_checkpoint_file_once(capsys, used, monkeypatch, damaged):
    """latest_verified reads and checks each file, and load parses those same bytes; a corrupt
    newest checkpoint is read up to its first bad file and skipped, the older one read once."""
    script_path, out = used
    if damaged:
        damage_file("params.safetensors", "flip")(out)
    real_read = Path.read_bytes
    reads = []

    def read_bytes(self):
        if self.parent.parent == out / "checkpoints":
            reads.append(f"{self.parent.name}/{self.name}")
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, stdout, err = run(capsys, script_path, out, "--resume", "--keep", "10", steps=8)
    monkeypatch.undo()
    assert code == 0, err
    start = 4 if damaged else 6
    assert f"step-{start:08d} (step {start})" in err, err
    names = ["state.json", "params.safetensors", "opt_state.safetensors"]
    expected = [f"step-{start:08d}/{name}" for name in names]
    if damaged:
        expected = ["step-00000006/state.json", "step-00000006/params.safetensors", *expected]
    assert reads == expected
    assert steps_logged(out) == list(range(1, 9)) and latest_step(out) == 8


# --------------------------------------------------------------------------- metrics.jsonl


def edit_metrics(out, edit):
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(edit(lines)))


METRICS_ERRORS = {  # id: (edit of the lines, words of the error line)
    "garbage line in the middle": (lambda ls: [*ls[:2], "#&*garbage\n", *ls[2:]], "line 3"),
    "a line without a step": (lambda ls: [*ls[:1], '{"loss": 1.0}\n', *ls[1:]], "line 2"),
    "binary junk line": (lambda ls: [*ls[:3], "\udcff\x00\x01\n", *ls[3:]], "line 4"),
}


@pytest.mark.parametrize("case", sorted(METRICS_ERRORS))
def test_damaged_metrics_stop_a_resume_and_change_nothing(capsys, used, case):
    edit, words = METRICS_ERRORS[case]
    script_path, out = used
    edit_metrics(out, lambda lines: [line.encode("utf-8", "surrogateescape").decode(
        "utf-8", "replace") for line in edit(lines)])
    before = snapshot(out)
    code, stdout, err = run(capsys, script_path, out, "--resume", "--keep", "10", steps=8)
    assert code == 2, err
    check_clean(err, "metrics.jsonl", words, script=script_path)
    assert snapshot(out) == before


METRICS_OK = {  # id: (edit of the lines, the steps logged after resuming to step 8)
    "torn last line": (lambda ls: [*ls, '{"step": 7, "lo'], list(range(1, 9))),
    "metrics.jsonl emptied": (lambda ls: [], [7, 8]),
    "lines past the checkpoint": (lambda ls: [*ls, '{"step": 9, "loss": 1.0}\n'], [*range(1, 9)]),
}


@pytest.mark.parametrize("case", sorted(METRICS_OK))
def test_metrics_that_can_be_mended_are_on_resume(capsys, used, case):
    edit, steps = METRICS_OK[case]
    script_path, out = used
    edit_metrics(out, edit)
    code, stdout, err = run(capsys, script_path, out, "--resume", "--keep", "10", steps=8)
    assert code == 0, err
    check_clean(err, script=script_path, error=False)
    assert steps_logged(out)[-4:] == steps[-4:] and steps_logged(out) == sorted(steps_logged(out))


def test_plot_names_a_damaged_metrics_line(capsys, used):
    require("matplotlib")
    script_path, out = used
    edit_metrics(out, lambda lines: [*lines[:2], "garbage\n", *lines[2:]])
    code, stdout, err = invoke(capsys, "plot", out)
    assert code == 2
    check_clean(err, "metrics.jsonl", "line 3")
    assert not (out / "loss.png").exists()


# --------------------------------------------------------------------------- resume mismatches


RESUME_MISMATCH = {  # id: (extra args, words of the error line)
    "another seed": (("--seed", "1"), "seed"),
    "another lr": (("--set", "lr=0.1"), "lr"),
    "steps before the checkpoint": (("--steps", "3"), "step 6"),
}


def run_mismatch_case(capsys, used, case):
    extra, words = case
    script_path, out = used
    before = snapshot(out)
    args = ["run", script_path, "--json", "--no-report", "--out", out, "--resume"]
    code, stdout, err = invoke(capsys, *args, *(extra if "--steps" in extra else
                                               ("--steps", "8", *extra)))
    assert code == 2, err
    check_clean(err, words, script=script_path)
    assert snapshot(out) == before


@pytest.mark.parametrize("case", sorted(RESUME_MISMATCH))
def test_resume_with_another_config_changes_nothing(capsys, used, case):
    run_mismatch_case(capsys, used, RESUME_MISMATCH[case])


def test_resume_of_meta_edited_to_another_lr_is_refused(capsys, used):
    script_path, out = used
    for step in (2, 4, 6):
        edit_state(out / CKPT.format(step), lambda s: s["meta"]["config"].update(lr=0.5))
    before = snapshot(out)
    code, stdout, err = run(capsys, script_path, out, "--resume", "--keep", "10", steps=8)
    assert code == 2, err
    check_clean(err, "lr", script=script_path)
    assert snapshot(out) == before


# --------------------------------------------------------------------------- prepared corpus

BYTELM = Path(__file__).resolve().parents[2] / "examples" / "bytelm.py"
TINY = ("--set", "d_model=16", "--set", "n_layers=1", "--set", "n_heads=2", "--set", "seq_len=8",
        "--set", "batch_size=2", "--set", "eval_batches=1", "--set", "warmup_steps=0")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "src").mkdir()
    for index in range(30):
        (root / "src" / f"m{index:02d}.py").write_text(f"def f{index}(x):\n    return x + 1\n" * 4)
    data.prepare(root / "bytes", root / "src")
    return root / "bytes"


def append_byte(path):
    with open(path, "ab") as handle:
        handle.write(b"\0")


def flip(path):
    content = bytearray(path.read_bytes())
    content[10] ^= 1
    path.write_bytes(bytes(content))


CORPUS = {  # id: (file, damage, exit code, words of the error line)
    "stray byte appended to train.bin": ("train.bin", append_byte, "train.bin has"),
    "stray byte appended to val.bin": ("val.bin", append_byte, "val.bin has"),
    "train.bin edited": ("train.bin", flip, "SHA-256"),
    "val.bin cut short": ("val.bin", lambda p: p.write_bytes(p.read_bytes()[:-4]), "val.bin"),
    "train.bin deleted": ("train.bin", lambda p: p.unlink(), "train.bin is missing"),
    "meta.json garbage": ("meta.json", lambda p: p.write_text("{]"), "meta.json"),
    "meta.json deleted": ("meta.json", lambda p: p.unlink(), "no meta.json"),
    "val.bin edited": ("val.bin", flip, "SHA-256"),
    "meta.json dtype int64": (
        "meta.json", lambda p: p.write_text(p.read_text().replace('"uint16"', '"int64"')),
        "dtype"),
    "meta.json token count negative": (
        "meta.json", lambda p: p.write_text(json.dumps({**json.loads(p.read_text()),
                                                        "tokens": {"train": -1, "val": 1}})),
        "token counts"),
    "meta.json digest not hex": (
        "meta.json", lambda p: p.write_text(json.dumps({**json.loads(p.read_text()),
                                                        "sha256": {"train": "x", "val": "y"}})),
        "SHA-256"),
    "meta.json vocab_size": (
        "meta.json", lambda p: p.write_text(p.read_text().replace('"vocab_size": 256',
                                                                  '"vocab_size": -1')),
        "vocab_size"),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_a_damaged_corpus_is_named_and_never_rebuilt(capsys, corpus, tmp_path, case):
    name, damage, words = CORPUS[case]
    copy = tmp_path / "bytes"
    shutil.copytree(corpus, copy)
    damage(copy / name)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    code, stdout, err = invoke(capsys, "run", BYTELM, "--json", "--no-report", "--steps", "2",
                               *TINY, "--set", f"data_dir={copy}", "--out", tmp_path / "run")
    assert code == 2, err
    check_clean(err, words, str(copy))
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bytelm_on_an_empty_data_dir_says_how_to_prepare(capsys, tmp_path):
    code, stdout, err = invoke(capsys, "run", BYTELM, "--json", "--no-report", "--steps", "2",
                               *TINY, "--set", f"data_dir={tmp_path / 'absent'}")
    assert code == 2, err
    check_clean(err, "minitrain prepare --out", "absent")
    assert not (tmp_path / "absent").exists()


def test_bytelm_trains_on_an_intact_custom_corpus(capsys, corpus, tmp_path):
    code, stdout, err = invoke(capsys, "run", BYTELM, "--json", "--no-report", "--steps", "2",
                               *TINY, "--set", f"data_dir={corpus}")
    assert code == 0, err
    assert json.loads(stdout)["steps"] == 2
