"""Replicas proven on rejoin (issue 24, item 4), with real `odrl serve-teacher` processes on
127.0.0.1: a replica killed and restarted at its address with another teacher is checked like a new
one (its /info fingerprint and layout) before it gets work. It stays out of rotation with a logged
sentence while the others answer; when it is the only one left, the run stops with a sentence. A
distillation run whose replica is restarted with another teacher mid-run logs the losses of the
teacher in process."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.serving.process import ServerProcess
from omni_diffusion_rl.serving.teacher_client import RemoteTeacher, TeacherUnavailable
from teachers.flow_policy import FlowPolicyTeacher

from .helpers import ENV, REPO, fast_overrides, odrl, step_records, tiny_model_dir
from .test_teacher_server import teacher_servers

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]  # starts server processes
LATENT = 796
ANOTHER = "serves another teacher than the run's (fingerprint"
CLOSE = {"rtol": 1e-4, "atol": 1e-5}  # batches of other sizes round otherwise; another teacher is off by O(1)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("other"), seed=3)


def _states(n: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, LATENT, generator=gen), torch.rand(n, generator=gen), ["a red circle"] * n


@contextmanager
def _restarted(server: ServerProcess, model: Path) -> Iterator[ServerProcess]:
    """`server` killed (as a crash would) and another `odrl serve-teacher` started at its address,
    serving the tiny model at `model`."""
    server.kill()
    port = int(server.url.rsplit(":", 1)[1])
    options = json.dumps({"pretrained": str(model)})
    env = {**ENV, "OMP_NUM_THREADS": "1"}
    with ServerProcess(["policy"], "--options", options, port=port, command="serve-teacher", env=env) as new:
        assert new.url == server.url
        yield new


def test_a_replica_restarted_with_another_teacher_stays_out_and_the_answers_stay_the_teachers(
    teacher_dir: Path, other_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    x, t, prompts = _states(16)
    expected = FlowPolicyTeacher(pretrained=str(teacher_dir)).velocity(x, t, prompts)
    with teacher_servers(teacher_dir, 2) as (first, second):
        remote = RemoteTeacher([first.url, second.url], request_samples=2, timeout_s=10, health_every_s=0.05)
        torch.testing.assert_close(remote.velocity(x, t, prompts), expected, **CLOSE)
        first.kill()
        torch.testing.assert_close(remote.velocity(x, t, prompts), expected, **CLOSE)
        served_before = remote.stats()["teacher/replica0/samples"]
        with caplog.at_level(logging.WARNING), _restarted(first, other_dir):
            for _ in range(4):  # each request probes the replica that is out (its check is due)
                time.sleep(0.1)
                torch.testing.assert_close(remote.velocity(x, t, prompts), expected, **CLOSE)
            assert remote.stats()["teacher/replica0/samples"] == served_before, "no work for another teacher"
            assert not remote.pool.replicas[0].healthy
        logged = [r.getMessage() for r in caplog.records if ANOTHER in r.getMessage()]
        assert len(logged) == 1, caplog.text  # one sentence, not one per probe
        assert f"teacher replica {first.url} {ANOTHER}" in logged[0]
        assert "stays out of rotation until it serves the run's teacher" in logged[0]
        remote.close()


def test_a_replica_restarted_between_requests_is_proven_before_its_answer_is_used(
    teacher_dir: Path, other_dir: Path
) -> None:
    x, t, prompts = _states(8)
    expected = FlowPolicyTeacher(pretrained=str(teacher_dir)).velocity(x, t, prompts)
    with teacher_servers(teacher_dir, 2) as (first, second):
        remote = RemoteTeacher([first.url, second.url], request_samples=2, timeout_s=10)
        remote.velocity(x, t, prompts)
        remote.close()  # no connection is left: the next requests connect anew, with no failure seen
        with _restarted(first, other_dir):
            for _ in range(3):
                torch.testing.assert_close(remote.velocity(x, t, prompts), expected, **CLOSE)
            replica = remote.pool.replicas[0]
            assert not replica.healthy and ANOTHER in replica.last_error
        remote.close()


def test_the_only_replica_restarted_with_another_teacher_stops_with_a_sentence(
    teacher_dir: Path, other_dir: Path
) -> None:
    x, t, prompts = _states(4)
    with teacher_servers(teacher_dir, 1) as (server,):
        remote = RemoteTeacher([server.url], request_samples=2, timeout_s=10, health_every_s=0.05)
        remote.velocity(x, t, prompts)
        with _restarted(server, other_dir), pytest.raises(TeacherUnavailable) as refused:
            remote.velocity(x, t, prompts)
        message = str(refused.value)
        assert f"no teacher replica of 'policy' is left ({server.url}: {ANOTHER}" in message, message
        assert "with the run's teacher" in message
        remote.close()


def _train(model_dir: Path, teacher_dir: Path, run: Path, urls: list[str]) -> subprocess.Popen[str]:
    """`odrl train`: distillation from the teacher at `teacher_dir` (in process) or at `urls`."""
    overrides = [
        *fast_overrides(model_dir, run, 4),
        "train.eval_at_start_and_end=false",
        "algorithm.name=distill",
        f"teacher.options={{family: tiny_av, pretrained: {teacher_dir}}}",
        f"teacher.urls=[{', '.join(urls)}]",
        "teacher.request_samples=2",
        "teacher.health_every_s=0.05",
        "teacher.timeout_s=20",
    ]
    env = {**ENV, "OMP_NUM_THREADS": "1"}
    command = odrl("train", *overrides)
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _steps_logged(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _stop_after_first_step(trainer: subprocess.Popen[str], run: Path) -> None:
    """Stop the training process (SIGSTOP) once its first step is logged: what happens to the
    servers until it continues (SIGCONT) happens between two of its requests."""
    deadline = time.monotonic() + 180
    while _steps_logged(run) < 1 and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trainer.poll() is None and _steps_logged(run) >= 1, "the run did not reach its first step"
    os.kill(trainer.pid, signal.SIGSTOP)


def _finish_with(trainer: subprocess.Popen[str], server: ServerProcess, model: Path, run: Path) -> str:
    """Restart `server` with the teacher at `model` while the trainer is stopped after its first
    step, let the trainer run to its end and return its stderr."""
    try:
        _stop_after_first_step(trainer, run)
        with _restarted(server, model):
            os.kill(trainer.pid, signal.SIGCONT)
            return trainer.communicate(timeout=300)[1]
    finally:
        trainer.kill()  # nothing left to do when it finished; a stopped one is ended too


def test_a_run_whose_replica_comes_back_as_another_teacher_keeps_the_teachers_losses(
    teacher_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    student = tiny_model_dir(tmp_path / "student", seed=1)
    local = _train(student, teacher_dir, tmp_path / "local", [])
    _, err = local.communicate(timeout=300)
    assert local.returncode == 0, err[-3000:]
    run = tmp_path / "served"
    with teacher_servers(teacher_dir, 2) as (first, second):
        trainer = _train(student, teacher_dir, run, [first.url, second.url])
        err = _finish_with(trainer, first, other_dir, run)
    assert trainer.returncode == 0, err[-3000:]
    assert f"teacher replica {first.url} {ANOTHER}" in err, err[-3000:]
    served, expected = step_records(run), step_records(tmp_path / "local")
    assert len(served) == 4
    assert [r["loss/distill"] for r in served] == pytest.approx(
        [r["loss/distill"] for r in expected], rel=1e-6
    )


def test_a_run_whose_only_replica_comes_back_as_another_teacher_stops_with_a_sentence(
    teacher_dir: Path, other_dir: Path, tmp_path: Path
) -> None:
    student = tiny_model_dir(tmp_path / "student", seed=1)
    run = tmp_path / "run"
    with teacher_servers(teacher_dir, 1) as (server,):
        trainer = _train(student, teacher_dir, run, [server.url])
        err = _finish_with(trainer, server, other_dir, run)
    assert trainer.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"odrl: TeacherUnavailable: no teacher replica of 'policy' is left ({server.url}: {ANOTHER}" in err
