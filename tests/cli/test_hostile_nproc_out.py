"""Hostile cases of ``--nproc`` and ``--out``: one error line for a dead worker, and a run
directory removed (or moved) while the run trains.

The real kill of a worker under ``--nproc 2`` is tests/train/test_distributed.py's
``test_a_killed_worker_ends_the_job_naming_its_rank``; here the worker and launcher sides are
checked in-process.
"""

from __future__ import annotations

import os
import shutil
import textwrap
from types import SimpleNamespace

import pytest
import torch
from test_hostile_harness import (
    EXIT,
    check_clean,
    check_kept,
    latest_step,
    run,
    snapshot,
    steps_logged,
    strict_json,
)

from minitrain import distributed, rundir
from minitrain.cli import errors as cli_errors
from minitrain.cli import launch


def failure(exitcode, pid, timestamp=0):
    return SimpleNamespace(exitcode=exitcode, pid=pid, timestamp=timestamp)


class FakeParallel(distributed.DataParallel):
    """Rank 0 of a job whose peers are gone (no process group is joined)."""

    def __init__(self):
        super().__init__(rank=0, world_size=2, device=torch.device("cpu"))

    def barrier(self):
        raise AssertionError("a worker that lost its peers must not wait for them")

    def close(self):
        raise AssertionError("a worker that lost its peers exits at once")


def lost_peer() -> distributed.LostPeer:
    with pytest.raises(distributed.LostPeer) as info, distributed.collective(
        "the gradient all-reduce"
    ):
        raise RuntimeError("[gloo] Connection reset by peer")
    return info.value


# --------------------------------------------------------------------------- a dead worker


def test_a_lost_peer_is_a_distributed_error_the_cli_tells_apart():
    exc = lost_peer()
    assert isinstance(exc, distributed.DistributedError)
    assert "the gradient all-reduce failed: another worker stopped" in str(exc)
    assert type(cli_errors.as_cli_error(exc)) is cli_errors.LostPeer
    assert cli_errors.as_cli_error(exc).exit_code == 1
    # Ranks that disagree are a root cause of their own, printed as before.
    other = cli_errors.as_cli_error(distributed.DistributedError("the ranks disagree on x"))
    assert type(other) is cli_errors.RunFailed


@pytest.mark.parametrize("raised", ["cli", "library", "runtime"])
def test_a_worker_of_nproc_leaves_a_lost_peer_to_the_launcher(raised, tmp_path, monkeypatch,
                                                                capsys):
    monkeypatch.setenv(launch.REPORTS_ENV, str(tmp_path))
    exc = {"cli": cli_errors.as_cli_error(lost_peer()), "library": lost_peer(),
           "runtime": RuntimeError("[gloo] Connection closed by peer")}[raised]
    with pytest.raises(SystemExit) as exit_info, launch.worker_outcome(FakeParallel()):
        raise exc
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == ""
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0"]
    assert (tmp_path / "rank-0").read_text().startswith("rank 0: ")


def test_a_worker_under_torchrun_prints_a_lost_peer(monkeypatch, capsys):
    monkeypatch.delenv(launch.REPORTS_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info, launch.worker_outcome(FakeParallel()):
        raise lost_peer()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: rank 0: the gradient all-reduce failed") and err.count("\n") == 1


def test_the_launcher_names_the_root_cause_once():
    lost = {0: "rank 0: the gradient all-reduce failed: another worker stopped or lost contact"}
    killed = SimpleNamespace(failures={0: failure(1, 10), 1: failure(-9, 11)})
    with pytest.raises(launch.DistributedError, match=r"^worker rank 1 \(pid 11\) was killed by"):
        launch._raise_failure(killed, lost)
    # A rank that failed on its own printed its error: its exit code, nothing more.
    crashed = SimpleNamespace(failures={0: failure(1, 10), 1: failure(2, 11)})
    with pytest.raises(SystemExit) as exit_info:
        launch._raise_failure(crashed, lost)
    assert exit_info.value.code == 2
    # Only lost peers (a collective timed out), the others stopped by the agent: the first.
    timed_out = SimpleNamespace(failures={0: failure(1, 10), 1: failure(-15, 11)})
    with pytest.raises(launch.DistributedError) as info:
        launch._raise_failure(timed_out, lost)
    assert str(info.value) == lost[0]


def test_the_launcher_reads_only_the_reports_of_ranks(tmp_path):
    (tmp_path / "rank-1").write_text("rank 1: lost\n")
    (tmp_path / ".rank-0.tmp").write_text("half")
    (tmp_path / "rank-x").write_text("junk")
    (tmp_path / "rank-2").write_text("")
    assert launch._read_reports(tmp_path) == {1: "rank 1: lost"}
    assert launch._read_reports(tmp_path / "missing") == {}


def test_the_launcher_sets_the_reports_folder_only_while_workers_run(monkeypatch):
    import torch.distributed.launcher.api as launcher_api

    seen = []
    monkeypatch.delenv(launch.REPORTS_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def workers(*argv):
        seen.append((os.environ[launch.REPORTS_ENV], os.environ["OMP_NUM_THREADS"]))

    monkeypatch.setattr(launcher_api, "elastic_launch", lambda config, entry: workers)
    launch.launch(2, ["run", "script.py"])
    assert seen[0][0].endswith("reports") and int(seen[0][1]) >= 1
    assert launch.REPORTS_ENV not in os.environ and "OMP_NUM_THREADS" not in os.environ


# --------------------------------------------------------------------------- a removed --out

# linreg whose next_batch removes (or moves, or empties of its lock) the run directory at a
# given step, as `rm -rf DIR` in another terminal would.
REMOVER = textwrap.dedent(
    '''
    import os, shutil
    import torch
    import minitrain as mt

    CONFIG = {"dim": 4, "batch_size": 4, "steps": 20, "out": "", "at": 0, "how": "rm"}

    def experiment(config):
        calls = [0]

        def next_batch(generator):
            calls[0] += 1
            out = config["out"]
            if calls[0] == config["at"] and os.path.isdir(out):
                if config["how"] == "rm":
                    shutil.rmtree(out)
                elif config["how"] == "replace":
                    shutil.rmtree(out)
                    os.mkdir(out)
                elif config["how"] == "lock":
                    os.unlink(os.path.join(out, ".lock"))
                else:
                    os.rename(out, config["how"])
            x = torch.randn(config["batch_size"], config["dim"], generator=generator)
            return x, x.sum(dim=1)

        def loss(params, batch):
            x, y = batch
            return ((x @ params["w"] - y) ** 2).mean()

        return mt.Experiment(
            name="remover", init=lambda g: {"w": torch.zeros(config["dim"])}, loss=loss,
            next_batch=next_batch, optimizer=mt.optim.sgd(lr=0.05), steps=config["steps"],
        )
    '''
)


def remover(tmp_path, capsys, out, at, how="rm", *args):
    script = tmp_path / "remover.py"
    script.write_text(REMOVER)
    return run(capsys, script, out, "--checkpoint-every", "5", "--set", f"out={out}",
               "--set", f"at={at}", "--set", f"how={how}", *args, steps=20)


def test_the_owner_tells_a_removed_moved_or_replaced_directory(tmp_path):
    out = tmp_path / "run"
    owner = rundir.claim(out, resume=False, overwrite=False)
    try:
        assert owner.gone() is None
        os.rename(out, tmp_path / "moved")
        assert owner.gone() == rundir.Gone("moved", tmp_path / "moved")
        os.rename(tmp_path / "moved", out)
        assert owner.gone() is None
        (out / rundir.LOCK_FILE).unlink()
        assert owner.gone() == rundir.Gone("removed")
        shutil.rmtree(out)
        assert owner.gone() == rundir.Gone("removed")
        out.mkdir()  # another directory in its place is not this run's
        assert owner.gone() == rundir.Gone("removed")
    finally:
        owner.release()


@pytest.mark.parametrize("how", ["rm", "replace"])
def test_a_removed_run_directory_stops_the_run_saying_so(how, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = remover(tmp_path, capsys, out, 8, how)
    assert code == EXIT["failed"]
    check_clean(err, f"the run directory {out} was removed while the run trained (noticed at "
                "step 8)", "its checkpoints went with it (the last was step 5)")
    # Nothing was written into a recreated directory: no checkpoint, no metrics, no summary.
    assert sorted(os.listdir(out)) == [] if how == "replace" else not out.exists()


def test_a_run_directory_removed_before_any_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = remover(tmp_path, capsys, out, 2)
    assert code == EXIT["failed"]
    check_clean(err, "was removed", "(noticed at step 2)", "no checkpoint had been saved")
    assert not out.exists()


def test_a_removed_lock_file_stops_the_run_and_keeps_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = remover(tmp_path, capsys, out, 13, "lock")
    assert code == EXIT["failed"]
    check_clean(err, "was removed in part", "(noticed at step 13)",
                f"the last checkpoint (step 10) is still in {out / 'checkpoints'}")
    assert latest_step(out) == 10


def test_a_moved_run_directory_names_where_it_went_and_resumes_there(tmp_path, capsys):
    out, moved = tmp_path / "run", tmp_path / "moved"
    code, _, err = remover(tmp_path, capsys, out, 8, str(moved))
    assert code == EXIT["failed"]
    check_clean(err, f"was moved to {moved}", "(noticed at step 8)",
                f"the last checkpoint (step 5) is in {moved / 'checkpoints'}",
                f"--resume --out {moved}")
    assert not out.exists()
    before = snapshot(moved)
    assert latest_step(moved) == 5 and steps_logged(moved) == list(range(1, 8))
    # The same config (a resumed run must have it); its `out` is gone, so nothing moves again.
    script = tmp_path / "remover.py"
    code, stdout, err = run(capsys, script, moved, "--checkpoint-every", "5", "--set",
                            f"out={out}", "--set", "at=8", "--set", f"how={moved}", "--resume",
                            "--keep", "10", steps=20)
    assert code == EXIT["ok"], err
    assert strict_json(stdout)["steps"] == 20
    check_kept(before, moved, up_to=5)
