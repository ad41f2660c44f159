"""Hostile cases of ``--nproc`` and ``--out``: one error line for a dead worker, and a run
directory removed (or moved) while the run trains.

The real kill of a worker under ``--nproc 2`` is tests/test_distributed.py's
``test_a_killed_worker_ends_the_job_naming_its_rank``; here the worker and launcher sides are
checked in-process.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from minitrain import distributed
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
    monkeypatch.delenv(launch.REPORTS_ENV, raising=False)
    with launch._environment(launch.REPORTS_ENV, "/somewhere"):
        assert os.environ[launch.REPORTS_ENV] == "/somewhere"
    assert launch.REPORTS_ENV not in os.environ
