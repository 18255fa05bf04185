"""Teacher servers (`odrl serve-teacher`) and the scheduler that routes across replicas, with real
server processes on 127.0.0.1: answers equal the in-process teacher, bad requests get 4xx and the
server keeps serving, a killed replica's requests are rerouted, no replica left is a clear error,
a slow replica gets fewer requests, a broken teacher is never a silent target. Each server start
costs seconds of CPU: servers that tests only send requests to start once for the module."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.runtime.threads import thread_share
from omni_diffusion_rl.serving import teacher_client
from omni_diffusion_rl.serving.process import ServerProcess
from omni_diffusion_rl.serving.teacher_client import RemoteTeacher, TeacherUnavailable
from omni_diffusion_rl.serving.teacher_wire import encode_states
from omni_diffusion_rl.teacher import TeacherMismatch
from teachers.flow_policy import FlowPolicyTeacher

from .helpers import ENV, tiny_model_dir

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]  # starts server processes
LATENT = 796
HANG_S = 60.0  # only stops a hang: no verdict depends on how fast anything is
# A teacher whose servers the tests control through files in the folder ODRL_TEST_TEACHER_CONTROL:
# once `die` exists a call ends the server's process (as a crash would), while `hold` exists it
# answers nothing, while `nan` exists its answers are NaN, and `fail_once` makes its next call fail
# (the file is removed).
CONTROLLED = """
import os
import time
from pathlib import Path

from omni_diffusion_rl.registry import teachers
from teachers.flow_policy import FlowPolicyTeacher


@teachers.register("test_controlled_teacher", overwrite=True)
class ControlledTeacher(FlowPolicyTeacher):
    def velocity(self, x_t, t, prompts):
        control = Path(os.environ["ODRL_TEST_TEACHER_CONTROL"])
        if (control / "die").exists():
            os._exit(17)
        while (control / "hold").exists():
            time.sleep(0.01)
        try:
            (control / "fail_once").unlink()
        except FileNotFoundError:
            pass
        else:
            raise RuntimeError("a passing fault")
        velocity = super().velocity(x_t, t, prompts)
        return velocity * float("nan") if (control / "nan").exists() else velocity
"""
CONTROLLED_NAME = "test_controlled_teacher"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("teacher"))


@contextmanager
def teacher_servers(
    model_dir: Path, count: int, *extra: str, name: str = "policy", env: dict[str, str] | None = None
) -> Iterator[list[ServerProcess]]:
    options = json.dumps({"pretrained": str(model_dir)})
    env = {**ENV, "OMP_NUM_THREADS": "1", **(env or {})}
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                ServerProcess([name], "--options", options, *extra, command="serve-teacher", env=env)
            )
            for _ in range(count)
        ]
        yield servers


TOKEN = "s3cret-token"


# Servers that tests only send requests to (none kills, restarts or stops one) start once for the
# module; a test that kills or restarts a server starts its own. Each module server is also one of the
# thread-budget cases, so that test reads their ready lines instead of starting three more servers.
@pytest.fixture(scope="module")
def replicas(model_dir: Path) -> Iterator[list[ServerProcess]]:
    """Two replicas of the policy teacher with small request limits (for the 4xx cases); OMP_NUM_THREADS=1
    and no --threads: a thread budget of 1."""
    with teacher_servers(model_dir, 2, "--max-request-mb", "1", "--max-batch", "8") as servers:
        yield servers


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """A replica of another model (another seed) whose trained_parts.json names the parts it was trained
    on, behind a bearer token (ODRL_TEACHER_TOKEN in its environment); neither --threads nor
    OMP_NUM_THREADS (empty counts as unset) but --replicas-on-host 2: a thread budget of the host's
    cores shared by 2. And that model's folder."""
    folder = tiny_model_dir(tmp_path_factory.mktemp("parts") / "video_only", seed=3)
    (folder / "trained_parts.json").write_text('{"parts": ["picture", "visibility"]}')
    options = json.dumps({"pretrained": str(folder)})
    env = {**ENV, "OMP_NUM_THREADS": "", "ODRL_TEACHER_TOKEN": TOKEN}
    extra = ("--replicas-on-host", "2")
    with ServerProcess(["policy"], "--options", options, *extra, command="serve-teacher", env=env) as server:
        yield server, folder


@dataclass(frozen=True)
class Controlled:
    process: ServerProcess
    control: Path  # its control folder (see CONTROLLED)

    @property
    def server(self) -> ServerProcess:
        """The replica's server, started again (at another port) if a test ended it: the test that
        makes it die comes last, so only another order of the tests pays a start for it."""
        if self.process.proc is None or self.process.proc.poll() is not None:
            self.process.start()
        return self.process


@pytest.fixture(scope="module")
def controlled(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Controlled]]:
    """Two replicas of test_controlled_teacher, each with its control folder (empty: it answers as
    the policy teacher does). The first is slow: every model call takes 200 ms more (--service-ms),
    and it computes on --threads 3 (over OMP_NUM_THREADS=1)."""
    folder = tmp_path_factory.mktemp("controlled")
    plugin = _controlled_plugin(folder)
    folders = [folder / "replica0", folder / "replica1"]
    extra = [("--service-ms", "200", "--threads", "3"), ()]
    with ExitStack() as stack:
        servers = []
        for control, options in zip(folders, extra, strict=True):
            control.mkdir()
            env = {"ODRL_TEST_TEACHER_CONTROL": str(control)}
            servers += stack.enter_context(
                teacher_servers(model_dir, 1, *options, *plugin, name=CONTROLLED_NAME, env=env)
            )
        yield [Controlled(server, control) for server, control in zip(servers, folders, strict=True)]


def _states(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, LATENT, generator=gen), torch.rand(n, generator=gen), ["a red circle"] * n


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/vnd.safetensors", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_answers_equal_the_teacher_in_process_and_requests_spread_over_replicas(
    model_dir: Path, replicas: list[ServerProcess]
) -> None:
    local = FlowPolicyTeacher(pretrained=str(model_dir))
    remote = RemoteTeacher([s.url for s in replicas], request_samples=4)
    assert remote.info() == local.info()
    x, t, prompts = _states(16)
    torch.testing.assert_close(remote.velocity(x, t, prompts), local.velocity(x, t, prompts), rtol=0, atol=0)
    stats = remote.stats()
    assert stats["teacher/replica0/samples"] + stats["teacher/replica1/samples"] == 16
    assert stats["teacher/replica0/samples"] > 0 and stats["teacher/replica1/samples"] > 0, stats
    remote.close()


def test_a_server_computes_on_its_thread_budget_and_says_so(
    replicas: list[ServerProcess], controlled: list[Controlled], guarded: tuple[ServerProcess, Path]
) -> None:
    """--threads wins; without it OMP_NUM_THREADS; without both, the host's cores shared by
    --replicas-on-host (two servers with torch's default threads each oversubscribed 2 cores)."""
    cases = [(controlled[0].server, 3), (replicas[0], 1), (guarded[0], thread_share(2))]
    for server, expected in cases:
        assert server.ready["threads"] == expected, (server.command[5:], server.ready)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(replicas: list[ServerProcess]) -> None:
    server = replicas[0]  # --max-request-mb 1 --max-batch 8
    url = f"{server.url}/velocity/policy"
    x, t, prompts = _states(4)
    bad = {
        "wrong latent": encode_states(torch.randn(4, 10), t, prompts),
        "NaN states": encode_states(x * float("nan"), t, prompts),
        "t outside [0, 1]": encode_states(x, t + 2, prompts),
        "prompt count": encode_states(x, t, prompts[:3]),
        "not safetensors": b"\x00" * 64,
    }
    for what, body in bad.items():
        status, answer = _post(url, body)
        assert status == 400, (what, status, answer[:200])
    status, _ = _post(url, encode_states(*_states(9)))
    assert status == 413, "more states than --max-batch"
    status, _ = _post(url, b"\x00" * (2 << 20))
    assert status == 413, "a body over --max-request-mb"
    assert _post(f"{server.url}/velocity/other", encode_states(x, t, prompts))[0] == 404
    status, answer = _post(url, encode_states(x, t, prompts))
    assert status == 200, answer[:200]


def test_a_token_is_required_when_set(
    guarded: tuple[ServerProcess, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ODRL_TEACHER_TOKEN", TOKEN)
    server, _ = guarded
    x, t, prompts = _states(2)
    assert _post(f"{server.url}/velocity/policy", encode_states(x, t, prompts))[0] == 401
    assert (
        _post(
            f"{server.url}/velocity/policy",
            encode_states(x, t, prompts),
            {"Authorization": f"Bearer {TOKEN}"},
        )[0]
        == 200
    )
    remote = RemoteTeacher([server.url])  # reads ODRL_TEACHER_TOKEN
    assert remote.velocity(x, t, prompts).shape == x.shape
    remote.close()


def _controlled_plugin(tmp_path: Path) -> tuple[str, str]:
    plugin = tmp_path / "controlled_teachers.py"
    plugin.write_text(CONTROLLED)
    return "--plugin", str(plugin)


def test_a_slow_replica_gets_fewer_requests(controlled: list[Controlled]) -> None:
    """The slow replica answers nothing until the fast one has answered every request the client
    did not leave with the slow one: the slow one holds its window's worth (2 of the 16 requests),
    the fast one answers the other 14, and only then does the slow one answer."""
    slow, hold, fast = controlled[0].server, controlled[0].control / "hold", controlled[1].server
    requests = 16
    hold.touch()
    try:
        remote = RemoteTeacher([slow.url, fast.url], name=CONTROLLED_NAME, request_samples=2)
        at_slow = remote.pool.replicas[0]
        opened: list[bool] = []

        def open_once_the_fast_one_is_done() -> None:
            deadline = time.monotonic() + HANG_S
            while remote.stats()["teacher/replica1/requests"] + at_slow.in_flight < requests:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            else:
                opened.append(True)
            hold.unlink(missing_ok=True)

        opener = threading.Thread(target=open_once_the_fast_one_is_done)
        opener.start()
        try:
            x, t, prompts = _states(2 * requests)
            assert remote.velocity(x, t, prompts).shape == x.shape
        finally:
            hold.unlink(missing_ok=True)
            opener.join(timeout=HANG_S)
        stats, window = remote.stats(), remote.pool.window
        remote.close()
    finally:
        hold.unlink(missing_ok=True)
    assert opened == [True], f"the fast replica never answered all but the slow one's requests: {stats}"
    answered = (stats["teacher/replica0/requests"], stats["teacher/replica1/requests"])
    assert answered == (window, requests - window), stats


def test_requests_waiting_for_a_slot_sleep_until_one_frees(
    model_dir: Path, controlled: list[Controlled], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queued requests are woken when a request ends, not by polling (which took CPU from replicas
    sharing the client's cores): with the timeout out of the way, a replica is picked at most once
    per request and once per wake-up of each waiting request."""
    monkeypatch.setattr(teacher_client, "SLOT_WAIT_S", 60.0)
    slow = controlled[0].server  # 200 ms a model call
    remote = RemoteTeacher([slow.url], name=CONTROLLED_NAME, request_samples=2, window=1)
    picks = 0
    real_pick = remote.pool.pick

    def counted_pick(tried: set[str]) -> object:
        nonlocal picks
        picks += 1
        return real_pick(tried)

    monkeypatch.setattr(remote.pool, "pick", counted_pick)
    x, t, prompts = _states(8)
    local = FlowPolicyTeacher(pretrained=str(model_dir))
    want = local.velocity(x, t, prompts)
    # requests of 2 against one batch of 8 (and 3 threads against 1): another summation order, so a
    # float tolerance
    torch.testing.assert_close(remote.velocity(x, t, prompts), want, rtol=1e-4, atol=1e-4)
    requests = 4
    assert picks <= requests + requests * (requests - 1), picks  # polling every 2 ms: hundreds
    assert len(remote.pool.slot_freed) == 0, "no request is left asleep"
    remote.close()


def test_a_teacher_answering_nan_is_an_error_never_a_target(controlled: list[Controlled]) -> None:
    server, nan = controlled[1].server, controlled[1].control / "nan"
    nan.touch()  # every answer NaN
    try:
        x, t, prompts = _states(4)
        status, answer = _post(f"{server.url}/velocity/{CONTROLLED_NAME}", encode_states(x, t, prompts))
        assert status == 500 and b"teacher_failed" in answer and b"finite: False" in answer
        remote = RemoteTeacher([server.url], name=CONTROLLED_NAME, retries=1, timeout_s=10)
        with pytest.raises(TeacherUnavailable, match="HTTP 500"):
            remote.velocity(x, t, prompts)
        remote.close()
    finally:
        nan.unlink(missing_ok=True)


def test_replicas_of_different_teachers_or_a_missing_one_are_refused(
    replicas: list[ServerProcess], guarded: tuple[ServerProcess, Path]
) -> None:
    a, b = replicas[0], guarded[0]  # the teacher, and a model of another seed
    with pytest.raises(TeacherMismatch, match="the teacher replicas serve different models"):
        RemoteTeacher([a.url, b.url], token=TOKEN)
    with pytest.raises(TeacherMismatch, match="does not serve 'nope'; it serves \\['policy'\\]"):
        RemoteTeacher([a.url], name="nope")


def _distill_run(
    model_dir: Path, teacher_dir: Path, run: Path, steps: int, urls: list[str], *extra: str
) -> list[str]:
    from .helpers import fast_overrides

    return [
        *fast_overrides(model_dir, run, steps),
        "train.eval_at_start_and_end=false",
        "algorithm.name=distill",
        f"teacher.options={{family: tiny_av, pretrained: {teacher_dir}}}",
        f"teacher.urls=[{', '.join(urls)}]" if urls else "teacher.urls=[]",
        "teacher.request_samples=2",
        *extra,
    ]


def _kill_after_step(server: ServerProcess, run: Path, step: int) -> threading.Thread:
    def watch() -> None:
        deadline, metrics = time.monotonic() + 120, run / "metrics.jsonl"
        while time.monotonic() < deadline and not (
            metrics.exists() and len(metrics.read_text().splitlines()) >= step
        ):
            time.sleep(0.02)
        server.kill()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_killed_replicas_are_rerouted_none_left_is_an_error_one_back_rejoins_and_a_run_survives_one(
    model_dir: Path, replicas: list[ServerProcess], tmp_path: Path
) -> None:
    """Two replicas of this test's own (the module's are never killed). A client's requests go to
    the one left when the other is killed; with both killed, a clear error; one restarted at its
    address rejoins. That one then serves a distillation run beside a module replica and is killed
    after the run's first step: the run goes on and logs the losses of the teacher in process."""
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.trainers.trainer import Trainer

    from .helpers import step_records

    with teacher_servers(model_dir, 2) as (first, second):
        port = second.url.rsplit(":", 1)[1]
        second.command[second.command.index("--port") + 1] = port  # it comes back at its address
        remote = RemoteTeacher([first.url, second.url], request_samples=4, timeout_s=10, health_every_s=0.1)
        x, t, prompts = _states(16)
        expected = remote.velocity(x, t, prompts)
        first.kill()
        torch.testing.assert_close(remote.velocity(x, t, prompts), expected, rtol=0, atol=0)
        stats = remote.stats()
        assert stats["teacher/retries"] >= 1 and stats["teacher/replica0/failures"] >= 1, stats
        second.kill()
        with pytest.raises(
            TeacherUnavailable, match="no teacher replica of 'policy' is left .*Cannot connect"
        ):
            remote.velocity(x, t, prompts)
        second.start()  # the same address again
        assert remote.velocity(x, t, prompts).shape == x.shape, "back in rotation once /health answers"
        remote.close()

        student = tiny_model_dir(tmp_path / "student", seed=1)
        Trainer(load_config(None, _distill_run(student, model_dir, tmp_path / "local", 4, []))).fit()
        run, urls = tmp_path / "served", [second.url, replicas[1].url]
        watcher = _kill_after_step(second, run, 1)
        Trainer(load_config(None, _distill_run(student, model_dir, run, 4, urls))).fit()
        watcher.join(timeout=30)
    served, local = step_records(run), step_records(tmp_path / "local")
    assert [r["loss/distill"] for r in served] == pytest.approx([r["loss/distill"] for r in local], rel=1e-6)
    assert served[-1]["teacher/retries"] >= 1 and served[-1]["teacher/replica1/samples"] > 0, served[-1]
    assert all(r["teacher/seconds"] > 0 for r in served)


def test_one_replica_that_fails_once_is_used_again(model_dir: Path, controlled: list[Controlled]) -> None:
    server = controlled[1].server
    (controlled[1].control / "fail_once").touch()  # its next call fails
    remote = RemoteTeacher([server.url], name=CONTROLLED_NAME, retries=2, health_every_s=0.1)
    x, t, prompts = _states(4)
    expected = FlowPolicyTeacher(pretrained=str(model_dir)).velocity(x, t, prompts)
    torch.testing.assert_close(remote.velocity(x, t, prompts), expected, rtol=0, atol=0)
    stats = remote.stats()
    assert stats["teacher/retries"] == 1 and stats["teacher/replica0/failures"] == 1, stats
    remote.close()


def test_a_servers_info_carries_the_parts_its_teacher_was_trained_on(
    guarded: tuple[ServerProcess, Path],
) -> None:
    """trained_parts.json crosses /info: the client sees the parts (and refuses the teacher for
    others) as it would in process."""
    from omni_diffusion_rl.teacher import check_trained_parts

    server, folder = guarded
    remote = RemoteTeacher([server.url], token=TOKEN)
    info = remote.info()
    remote.close()
    in_process = FlowPolicyTeacher(pretrained=str(folder)).info()
    assert info.trained_parts == ("picture", "visibility") == in_process.trained_parts
    with pytest.raises(TeacherMismatch, match="not spectrum"):
        check_trained_parts(info, ["picture", "spectrum"], "teacher 'policy'")


def test_all_replicas_down_stops_the_run_with_a_clear_error_and_keeps_its_checkpoint(
    model_dir: Path, controlled: list[Controlled], tmp_path: Path
) -> None:
    """The teacher's server crashes (exits 17) at its first call once step 2's checkpoint exists, so in
    step 3: the run stops there with the error, and step 2's checkpoint is its latest. (The module's
    second controlled replica: this test comes last, see Controlled.server.)"""
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.trainers.trainer import Trainer

    from .helpers import step_records

    replica, run, name = controlled[1], tmp_path / "run", CONTROLLED_NAME
    server, die = replica.server, replica.control / "die"
    die.symlink_to(run / "checkpoints" / "step_0000002")  # exists once that checkpoint does
    try:
        overrides = _distill_run(
            model_dir, model_dir, run, 50, [server.url], "train.checkpoint_every=1", "teacher.timeout_s=5"
        )
        plugin = _controlled_plugin(tmp_path)[1]
        overrides += [f"teacher.name={name}", f"reward.plugins=[{plugin}]"]  # the name is known here too
        with pytest.raises(TeacherUnavailable, match=f"no teacher replica of '{name}' is left"):
            Trainer(load_config(None, overrides)).fit()
        assert server.proc is not None and server.proc.wait(timeout=HANG_S) == 17, "it died in a call"
    finally:
        die.unlink()
    assert [r["step"] for r in step_records(run)] == [1, 2], "stopped in step 3, the first without a teacher"
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_0000002" and (run / "checkpoints" / latest / "tensors.safetensors").is_file()
