"""Shared tools for the hostile-input corpus (tests/*/test_hostile_*.py); holds no tests itself.

Each case runs ``minitrain`` the way a hostile user would (in-process through the CLI entry
point where it can, in a subprocess where it needs real signals or resource limits) and checks
the same four things: the exit code the README promises (0 ok, 1 a failed run, 2 a user
mistake, 130 stopped), no traceback through minitrain's own frames (a traceback may show only
the user's script), exactly one ``error:`` line naming the thing, and that no checkpoint or
metrics line written before the case was lost.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minitrain import checkpoint
from minitrain.cli import main

ROOT = Path(__file__).resolve().parents[1]
LINREG = ROOT / "examples" / "linreg.py"
EXIT = {"ok": 0, "failed": 1, "usage": 2, "stopped": 130}

# A linreg-sized experiment whose every user function can be told (through --set fail=...) to
# raise, return junk or signal its own process at a given call: "<where>:<what>:<call>".
SCRIPT = textwrap.dedent(
    '''
    import os, signal, time
    import torch
    import minitrain as mt

    CONFIG = {"dim": 4, "batch_size": 4, "lr": 0.05, "steps": 6, "fail": "", "sleep": 0.0,
              "eval_every": 0, "has_aux": False, "evaluate": False, "setup_sleep": 0.0}


    class UserBug(Exception):
        pass


    class BaseBug(BaseException):  # what no `except Exception` catches
        pass


    def experiment(config):
        if config["setup_sleep"]:  # a slow setup; the marker file says it has begun
            open(__file__ + ".started", "w").close()
            time.sleep(config["setup_sleep"])
        dim, batch_size = config["dim"], config["batch_size"]
        where, what, at = (config["fail"].split(":") + ["", "", "0"])[:3]
        at, calls = int(at or 0), {}
        true_w = torch.arange(dim, dtype=torch.float32)

        def trouble(name, value):
            calls[name] = calls.get(name, 0) + 1
            if name != where or calls[name] != at:
                return value
            if what == "KeyError":
                return {}["missing_key"]
            if what == "ZeroDivisionError":
                return 1 / 0
            if what == "UserBug":
                raise UserBug(f"{name} gave up")
            if what == "MemoryError":
                raise MemoryError("user out of memory")
            if what == "ValueError":
                raise ValueError(f"{name} got a bad value")
            if what == "BaseBug":
                raise BaseBug(f"{name} gave up")
            if what == "KeyboardInterrupt":
                raise KeyboardInterrupt
            if what.startswith("exit"):
                raise SystemExit(int(what[4:]))
            if what.startswith(("sigterm", "sigint")):
                sig = signal.SIGTERM if what.startswith("sigterm") else signal.SIGINT
                for _ in range(int(what[7 if what.startswith("sigterm") else 6:] or 1)):
                    os.kill(os.getpid(), sig)
                return value
            return {"none": None, "str": "junk", "list": [1.0, 2.0], "nan": float("nan"),
                    "vector": torch.ones(3), "int64": {"w": torch.zeros(dim, dtype=torch.int64)},
                    "inf": float("inf"), "dictstr": {"acc": "high"},
                    "dictvec": {"acc": torch.ones(3)}, "dictnan": {"val": float("nan")}}[what]

        def init(generator):
            return trouble("init", {"w": torch.zeros(dim)})

        def next_batch(generator):
            time.sleep(config["sleep"])
            x = torch.randn(batch_size, dim, generator=generator)
            return trouble("next_batch", (x, x @ true_w))

        def loss(params, batch):
            x, y = batch
            value = ((x @ params["w"] - y) ** 2).mean()
            if where == "loss" and what in ("nan", "inf"):
                calls["loss"] = calls.get("loss", 0) + 1
                return value * float(what) if calls["loss"] == at else value
            value = trouble("loss", value)
            if config["has_aux"]:
                return value, trouble("aux", {"mean_y": y.mean()})
            return value

        def evaluate(params):
            return trouble("evaluate", {"val_norm": float(params["w"].norm())})

        return mt.Experiment(
            name="hostile", init=init, loss=loss, next_batch=next_batch,
            optimizer=mt.optim.sgd(lr=config["lr"]), steps=config["steps"],
            has_aux=config["has_aux"],
            evaluate=evaluate if config["evaluate"] else None, eval_every=config["eval_every"],
        )
    '''
)


def write_script(directory: Path) -> Path:
    """The hostile experiment script, written into ``directory`` (each test module's
    ``script`` fixture)."""
    path = Path(directory) / "hostile_script.py"
    path.write_text(SCRIPT)
    return path


@contextlib.contextmanager
def recorded_signals():
    """Signals that reach the test process outside minitrain's handlers are only recorded, so
    a case that fails cannot kill the test session; yields the list of those signals (each
    test module's ``safe_signals`` fixture)."""
    seen: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: seen.append(signum))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield seen
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class TookTooLong(Exception):
    """An in-process run went on past its time limit (a case that should have stopped)."""


def invoke(capsys, *args, limit: float = 60.0) -> tuple[int, str, str]:
    """Run the CLI in-process; return (exit code, stdout, stderr). A run still going after
    ``limit`` seconds is broken off with :class:`TookTooLong` (raised by a SIGALRM timer)."""

    def alarm(signum, frame):
        raise TookTooLong(f"still running after {limit} s: minitrain {' '.join(map(str, args))}")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([str(arg) for arg in args])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def run(capsys, script, out, *args, steps=6, limit=60.0) -> tuple[int, str, str]:
    """``minitrain run SCRIPT --json --no-report [--out OUT] --steps STEPS ARGS...``."""
    extra = ["--out", out] if out is not None else []
    return invoke(capsys, "run", script, "--json", "--no-report", "--steps", steps, *extra, *args,
                  limit=limit)


def spawn(*args, preexec_fn=None, env=None) -> subprocess.Popen:
    """``python -m minitrain ARGS...`` in a subprocess with pipes (text)."""
    return subprocess.Popen(
        [sys.executable, "-m", "minitrain", *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        preexec_fn=preexec_fn, env={**os.environ, **(env or {})},
    )


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Wait until ``path`` (a metrics.jsonl) holds ``count`` lines or ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.read_text().count("\n") >= count:
            return
        time.sleep(0.02)
    if proc.poll() is not None:
        raise AssertionError(f"exited {proc.returncode} early: {proc.stderr.read()[-2000:]}")
    raise AssertionError(f"{path} did not reach {count} lines in {timeout} s")


# --------------------------------------------------------------------------- the four checks


def check_clean(err: str, *names: str, script: Path | None = None, error: bool = True) -> None:
    """No traceback through minitrain's frames; exactly one ``error:`` line (if ``error``)
    that mentions every one of ``names`` (case-insensitive)."""
    frames = re.findall(r'File "([^"]+)"', err)
    user = {str(Path(script).resolve())} if script is not None else set()
    if "Traceback" in err or frames:
        foreign = [f for f in frames if str(Path(f).resolve()) not in user]
        assert frames and not foreign, f"traceback through {foreign or 'nothing'}:\n{err}"
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    if not error:
        assert not lines, err
        return
    assert len(lines) == 1, f"expected one error: line, got {len(lines)}:\n{err}"
    for name in names:
        assert name.lower() in lines[0].lower(), f"{name!r} not in {lines[0]!r}"


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file under ``out/checkpoints`` and ``out/metrics.jsonl``, by relative path. ``out``
    may belong to a live run: a directory or file that goes away during the walk (a checkpoint's
    temporary directory renamed, an old checkpoint pruned) is left out, not an error."""
    files = {}
    # os.walk skips a directory that vanishes before it is listed (its onerror is None).
    for root, dirs, names in os.walk(out):
        dirs.sort()
        for name in sorted(names):
            path = Path(root) / name
            rel = path.relative_to(out).as_posix()
            if rel.startswith("checkpoints/step-") or rel == "metrics.jsonl":
                try:
                    files[rel] = path.read_bytes()
                except (FileNotFoundError, IsADirectoryError):
                    continue
    return files


def metric_lines(files: dict[str, bytes]) -> list[str]:
    return files.get("metrics.jsonl", b"").decode(errors="replace").splitlines()


def check_kept(before: dict[str, bytes], out: Path, up_to: int | None = None) -> None:
    """Every checkpoint file of ``before`` is still there, byte for byte, and the metrics
    lines of ``before`` (those with step <= ``up_to``, if given) still open metrics.jsonl."""
    after = snapshot(out)
    for rel, content in before.items():
        if rel.startswith("checkpoints/"):
            assert after.get(rel) == content, f"{rel} was lost or changed"
    old = metric_lines(before)
    if up_to is not None:
        old = [line for line in old if _step(line) is None or _step(line) <= up_to]
    assert metric_lines(after)[: len(old)] == old, "metrics lines were lost"


def _step(line: str) -> int | None:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


def steps_logged(out: Path) -> list[int]:
    return [_step(line) for line in metric_lines(snapshot(out))]


def latest_step(out: Path) -> int | None:
    path = checkpoint.latest_valid(out, on_skip=lambda p, why: None)
    return None if path is None else checkpoint.verify(path)["step"]


def strict_json(text: str):
    """Parse JSON that must not hold NaN or Infinity."""

    def refuse(constant):
        raise AssertionError(f"JSON output holds {constant}")

    return json.loads(text, parse_constant=refuse)
