"""Replicas proven on rejoin (issue 24, item 4), with real `odrl serve-teacher` processes on
127.0.0.1: a replica killed and restarted at its address with another teacher is checked like a new
one (its /info fingerprint and layout) before it gets work. It stays out of rotation with a logged
sentence while the others answer; when it is the only one left, the run stops with a sentence. A
distillation run whose replica is restarted with another teacher mid-run logs the losses of the
teacher in process. One restart of one replica is seen by every client and run here: each server
start costs seconds of CPU."""

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


def _overrides(model_dir: Path, teacher_dir: Path, run: Path, urls: list[str]) -> list[str]:
    """Distillation from the teacher at `teacher_dir` (in process) or at `urls`."""
    return [
        *fast_overrides(model_dir, run, 4),
        "train.eval_at_start_and_end=false",
        "algorithm.name=distill",
        f"teacher.options={{family: tiny_av, pretrained: {teacher_dir}}}",
        f"teacher.urls=[{', '.join(urls)}]",
        "teacher.request_samples=2",
        "teacher.health_every_s=0.05",
        "teacher.timeout_s=20",
    ]


def _train(model_dir: Path, teacher_dir: Path, run: Path, urls: list[str]) -> subprocess.Popen[str]:
    """`odrl train` of `_overrides` in a process of its own (one the test can stop and continue)."""
    env = {**ENV, "OMP_NUM_THREADS": "1"}
    command = odrl("train", *_overrides(model_dir, teacher_dir, run, urls))
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _steps_logged(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _stop_after_first_step(runs: list[tuple[subprocess.Popen[str], Path]]) -> None:
    """Stop each training process (SIGSTOP) as soon as its first step is logged: what happens to the
    servers until it continues (SIGCONT) happens between two of its requests."""
    deadline, waiting = time.monotonic() + 180, list(runs)
    while waiting and time.monotonic() < deadline:
        for trainer, run in list(waiting):
            if _steps_logged(run) >= 1 or trainer.poll() is not None:
                os.kill(trainer.pid, signal.SIGSTOP)
                assert trainer.poll() is None, f"{run} ended before it could be stopped"
                waiting.remove((trainer, run))
        time.sleep(0.01)
    assert not waiting, f"{[str(run) for _, run in waiting]} did not reach its first step"


def test_a_replica_restarted_with_another_teacher_is_proven_before_it_gets_work(
    teacher_dir: Path, other_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """One replica (`first`, beside a steady one), killed and restarted at its address with another
    teacher, seen by three clients in this process and two training runs, all of which used it before:
    - a client that saw it die (its requests went to the steady replica meanwhile) keeps it out of
      rotation with one logged sentence while the answers stay the teacher's;
    - a client that holds no connection (it saw no failure) proves it on its next connection before
      using its answer;
    - a client whose only replica it is stops with a sentence;
    - the runs are stopped (SIGSTOP) after their first step until it is back, so it is restarted
      between two of their requests: the run with the steady replica too logs the sentence and the
      losses of the teacher in process; the run with no other replica stops with a sentence."""
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.trainers.trainer import Trainer

    student = tiny_model_dir(tmp_path / "student", seed=1)
    Trainer(load_config(None, _overrides(student, teacher_dir, tmp_path / "local", []))).fit()
    x, t, prompts = _states(16)
    expected = FlowPolicyTeacher(pretrained=str(teacher_dir)).velocity(x, t, prompts)
    served, alone = tmp_path / "served", tmp_path / "alone"
    with teacher_servers(teacher_dir, 2) as (first, steady):
        urls = [first.url, steady.url]
        runs = [(_train(student, teacher_dir, served, urls), served)]
        runs.append((_train(student, teacher_dir, alone, [first.url]), alone))
        try:
            remote = RemoteTeacher(urls, request_samples=2, timeout_s=10, health_every_s=0.05)
            unaware = RemoteTeacher(urls, request_samples=2, timeout_s=10)
            only = RemoteTeacher([first.url], request_samples=2, timeout_s=10, health_every_s=0.05)
            torch.testing.assert_close(remote.velocity(x, t, prompts), expected, **CLOSE)
            unaware.velocity(x[:8], t[:8], prompts[:8])
            unaware.close()  # no connection is left: the next requests connect anew, with no failure seen
            only.velocity(x[:4], t[:4], prompts[:4])
            _stop_after_first_step(runs)

            first.kill()
            torch.testing.assert_close(remote.velocity(x, t, prompts), expected, **CLOSE)
            served_before = remote.stats()["teacher/replica0/samples"]
            with caplog.at_level(logging.WARNING), _restarted(first, other_dir):
                for _ in range(4):  # each request probes the replica that is out (its check is due)
                    time.sleep(0.1)
                    torch.testing.assert_close(remote.velocity(x, t, prompts), expected, **CLOSE)
                assert remote.stats()["teacher/replica0/samples"] == served_before, (
                    "no work for another teacher"
                )
                assert not remote.pool.replicas[0].healthy
                logged = [r.getMessage() for r in caplog.records if ANOTHER in r.getMessage()]
                assert len(logged) == 1, caplog.text  # one sentence, not one per probe
                assert f"teacher replica {first.url} {ANOTHER}" in logged[0]
                assert "stays out of rotation until it serves the run's teacher" in logged[0]

                for _ in range(3):  # restarted between its requests
                    got = unaware.velocity(x[:8], t[:8], prompts[:8])
                    torch.testing.assert_close(got, expected[:8], **CLOSE)
                replica = unaware.pool.replicas[0]
                assert not replica.healthy and ANOTHER in replica.last_error

                with pytest.raises(TeacherUnavailable) as refused:  # its only replica
                    only.velocity(x[:4], t[:4], prompts[:4])
                message = str(refused.value)
                assert f"no teacher replica of 'policy' is left ({first.url}: {ANOTHER}" in message, message
                assert "with the run's teacher" in message
                for client in (remote, unaware, only):
                    client.close()

                for trainer, _ in runs:
                    os.kill(trainer.pid, signal.SIGCONT)
                err, alone_err = (trainer.communicate(timeout=300)[1] for trainer, _ in runs)
        finally:
            for trainer, _ in runs:
                trainer.kill()  # nothing left to do when it finished; a stopped one is ended too

    trainer = runs[0][0]
    assert trainer.returncode == 0, err[-3000:]
    assert f"teacher replica {first.url} {ANOTHER}" in err, err[-3000:]
    rows, local = step_records(served), step_records(tmp_path / "local")
    assert len(rows) == 4
    assert [r["loss/distill"] for r in rows] == pytest.approx([r["loss/distill"] for r in local], rel=1e-6)

    lonely = runs[1][0]
    assert lonely.returncode == 2, alone_err[-3000:]
    assert "Traceback" not in alone_err, alone_err[-3000:]
    refused_run = f"odrl: TeacherUnavailable: no teacher replica of 'policy' is left ({first.url}: {ANOTHER}"
    assert refused_run in alone_err, alone_err[-3000:]
