"""Reward server faults: stalled uploads, idle connections, Ctrl-C, bad tokens, absurd media, bad urls.

Servers run on 127.0.0.1, either in this process (on a thread with its own event loop, for settings the
command line does not expose) or as `odrl serve-reward` child processes. Every socket is closed by the
test that opened it, every server stopped by the test or module fixture that started it.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from safetensors.torch import save as save_tensors

import tests.plugin_rewards  # noqa: F401 - registers the test rewards in this process
from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward_factory import reward_from_config
from omni_diffusion_rl.serving.client import RemoteReward, RewardServerError
from omni_diffusion_rl.serving.process import ServerProcess
from omni_diffusion_rl.serving.server import ServeSettings, serve

from .helpers import ENV, REPO, odrl_main

PLUGIN = ("--plugin", "tests.plugin_rewards")
SCORE_PATH = "/score/test_prompt_length"
HANG_S = 30.0  # only stops a hang: far past every timeout a server here is meant to act on
LONG_S = "600"  # a server timeout that no test outlives: what it guards cannot end by itself meanwhile


def _subprocess_server(*args: str, names: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(names, *PLUGIN, *args, env={**ENV, **(env or {})}, cwd=REPO)


@contextmanager
def _in_process_server(settings: ServeSettings, names: list[str] | dict[str, Any]) -> Iterator[str]:
    """`serve()` on a thread with its own event loop, serving registered rewards by name (or the
    given reward objects by name); yields the url, stops it (as Ctrl-C would) after."""
    served = dict(names) if isinstance(names, dict) else {name: rewards.create(name) for name in names}
    loop = asyncio.new_event_loop()
    started = threading.Event()
    urls: list[str] = []
    task: asyncio.Task[None] | None = None

    def ready(url: str) -> None:
        urls.append(url)
        started.set()

    def run() -> None:
        nonlocal task
        asyncio.set_event_loop(loop)
        task = loop.create_task(serve(served, settings, ready=ready))
        try:
            loop.run_until_complete(task)
        except (asyncio.CancelledError, Exception):
            started.set()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="test-reward-server", daemon=True)
    thread.start()
    try:
        assert started.wait(30) and urls, "the in-process server did not start"
        yield urls[0]
    finally:
        if task is not None:
            loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=HANG_S)
        assert not thread.is_alive(), f"the in-process server had not stopped {HANG_S:g} s after Ctrl-C"


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _payload(tensors: dict[str, torch.Tensor], prompts: list[str], **meta: str) -> bytes:
    metadata = {"prompts": json.dumps(prompts), "fps": "8.0", "sample_rate": "8000", **meta}
    return save_tensors(tensors, metadata=metadata)


def _good_body(prompt: str = "abc") -> bytes:
    return _payload({"audio": torch.zeros(1, 1, 8)}, [prompt])


def _post(url: str, body: bytes, timeout: float = 10.0) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/vnd.safetensors"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _stalled_upload(host: str, port: int, path: str = SCORE_PATH) -> socket.socket:
    """A connection that sends a POST's headers (promising 1000 bytes) and 2 bytes of body, then stalls."""
    sock = socket.create_connection((host, port), timeout=10)
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 1000\r\n"
    sock.sendall(head.encode() + b"Content-Type: application/vnd.safetensors\r\n\r\n\x01\x02")
    return sock


def _read_until_closed(sock: socket.socket, within_s: float = HANG_S) -> bytes:
    """Everything the server sends until it closes the connection (a test failure after `within_s`)."""
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {within_s} s; it sent {data[:200]!r}")
    except ConnectionResetError:
        pass
    return data


def _head(answer: bytes) -> str:
    """An HTTP answer's status line and headers, lower case."""
    return answer.split(b"\r\n\r\n", 1)[0].decode(errors="replace").lower()


class _Gated:
    """A reward whose calls wait for `release` (the test's gate); `called` is set as a call starts."""

    def __init__(self) -> None:
        self.called, self.release = threading.Event(), threading.Event()

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        self.called.set()
        if not self.release.wait(HANG_S):
            raise RuntimeError(f"the test did not open the gate within {HANG_S:g} s")
        return torch.ones(len(prompts))


def _wait_for(condition: Callable[[], bool], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture(scope="module")
def patient_server() -> Iterator[Callable[[], ServerProcess]]:
    """The `odrl serve-reward` process of the tests that need the command itself (its --max-in-flight,
    its Ctrl-C), started once: --max-in-flight 8, no batching wait, keep-alive and read timeouts that
    no test outlives, test_slow sleeping as long. The Ctrl-C test stops it: a test that asks for it
    after that gets a new one."""
    started: list[ServerProcess] = []

    def live() -> ServerProcess:
        if not started or started[-1].proc is None or started[-1].proc.poll() is not None:
            args = ("--max-in-flight", "8", "--max-wait-ms", "0")
            args += ("--keepalive-timeout-s", LONG_S, "--read-timeout-s", LONG_S)
            names = ["test_prompt_length", "test_slow"]
            started.append(_subprocess_server(*args, names=names, env={"ODRL_TEST_SLOW_S": LONG_S}).start())
        return started[-1]

    yield live
    for srv in started:
        srv.kill()


@pytest.fixture(scope="module")
def quick_server() -> Iterator[str]:
    """An in-process server with short read/keep-alive timeouts and a small in-flight limit."""
    settings = ServeSettings(
        port=0, max_in_flight=4, read_timeout_s=0.5, keepalive_timeout_s=1.0, shutdown_timeout_s=1.0
    )
    with _in_process_server(settings, ["test_prompt_length"]) as url:
        yield url


# ---------------------------------------------------------------------------------------------------------
# 1. Slow uploads (slowloris) and idle connections


@pytest.mark.slow  # starts a reward server process
def test_stalled_uploads_do_not_make_real_requests_wait_or_fail(
    patient_server: Callable[[], ServerProcess],
) -> None:
    """300 uploads that stall after 2 bytes against --max-in-flight 8: a real request is answered
    while every one of them is still being received (their read timeout is far past the test)."""
    srv = patient_server()
    host, port = _host_port(srv.url)
    stalled: list[socket.socket] = []
    try:
        for _ in range(300):
            stalled.append(_stalled_upload(host, port))
        reading = _wait_for(lambda: _get_json(f"{srv.url}/info").get("reading", 0) >= 300, HANG_S)
        assert reading, "the server did not start receiving the 300 uploads"
        try:
            code, answer = _post(srv.url + SCORE_PATH, _good_body(), timeout=HANG_S)
        except OSError as e:  # urllib's timeout
            pytest.fail(f"a real request got no answer behind 300 stalled uploads: {e}")
        assert code == 200 and answer["scores"] == [3.0], f"{code} {answer}"
        info = _get_json(f"{srv.url}/info")
        assert info["reading"] == 300 and info["in_flight"] == 0, (
            f"answered while all 300 uploads were still pending: {info}"
        )
    finally:
        for sock in stalled:
            sock.close()


def test_bodies_arriving_at_once_are_bounded_by_max_uploads_mb() -> None:
    """A stalled upload declaring 1000 bytes against a budget of 1048: a second body that would not
    fit gets 503 at once (its connection closed), and is received once the stalled one is gone. The
    stalled upload's read timeout is far past the test, so it is still arriving at the 503."""
    settings = ServeSettings(
        port=0,
        max_request_mb=0.001,
        max_uploads_mb=0.001,
        read_timeout_s=float(LONG_S),
        keepalive_timeout_s=1.0,
    )
    with _in_process_server(settings, ["test_prompt_length"]) as url:
        host, port = _host_port(url)
        body = _good_body()
        assert 1000 + len(body) > 0.001 * 2**20 >= len(body), len(body)
        with _stalled_upload(host, port):
            assert _wait_for(lambda: _get_json(f"{url}/info").get("reading") == 1, HANG_S)
            code, answer = _post(url + SCORE_PATH, body)
            assert code == 503 and answer["kind"] == "busy" and "max_uploads_mb=0.001" in answer["error"]
        # the stalled upload's client went away: what it had declared no longer counts
        assert _wait_for(lambda: _get_json(f"{url}/info")["arriving_mb"] == 0, HANG_S)
        code, answer = _post(url + SCORE_PATH, body)
        assert code == 200, answer
    with pytest.raises(ValueError, match="max_uploads_mb .* must be a number of MB at least max_request_mb"):
        ServeSettings(max_uploads_mb=1.0).check()


def test_an_upload_that_stalls_past_the_read_timeout_gets_408_and_is_closed(quick_server: str) -> None:
    """The 408 names the read timeout and says the connection closes; the server then closes it
    and counts the upload as arriving no more."""
    host, port = _host_port(quick_server)
    with _stalled_upload(host, port) as sock:
        data = _read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert "connection: close" in _head(data), data[:300]
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body["kind"] == "timeout" and "read_timeout_s=0.5" in body["error"], body
    info = lambda: _get_json(f"{quick_server}/info")  # noqa: E731
    assert _wait_for(lambda: info()["reading"] == 0 and info()["arriving_mb"] == 0, HANG_S), info()
    assert _post(quick_server + SCORE_PATH, _good_body()) == (
        200,
        {"scores": [3.0], "components": {"batch": [1.0]}},
    )


@pytest.mark.parametrize(
    "sent", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half headers"]
)
def test_a_connection_that_sends_no_complete_request_is_closed(quick_server: str, sent: bytes) -> None:
    """Closed by the server (its keep-alive timeout is 1 s), without a byte of answer."""
    host, port = _host_port(quick_server)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(sent)
        data = _read_until_closed(sock)
    assert data == b"", data[:200]


def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout(quick_server: str) -> None:
    host, port = _host_port(quick_server)
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        assert response.status == 200 and response.read() == b'{"status": "ok"}'
        assert conn.sock is not None, "the connection must be kept alive after the first request"
        assert "connection: close" not in response.getheader("Connection", "").lower()
        data = _read_until_closed(conn.sock)  # closed by the server (keep-alive timeout 1 s)
        assert data == b"", data[:200]
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------------------
# 2. Prompt shutdown


@pytest.mark.slow  # starts a reward server process
def test_ctrl_c_stops_the_server_within_seconds_whatever_its_connections_do(
    patient_server: Callable[[], ServerProcess],
) -> None:
    """An idle keep-alive connection, a stalled upload and a request inside a model call: each of them
    would last 600 s (the server's keep-alive and read timeouts, the call's sleep), so a server that
    exits at all before HANG_S did not wait for any of them."""
    srv = patient_server()
    idle_now = lambda: _get_json(f"{srv.url}/info")  # noqa: E731
    # connections an earlier test closed are gone: what is pending below is this test's
    assert _wait_for(lambda: (idle_now()["reading"], idle_now()["in_flight"]) == (0, 0), HANG_S), idle_now()
    host, port = _host_port(srv.url)
    idle = http.client.HTTPConnection(host, port, timeout=10)
    opened: list[socket.socket] = []
    try:
        idle.request("GET", "/health")
        assert idle.getresponse().read() == b'{"status": "ok"}'
        opened.append(_stalled_upload(host, port))
        scoring = socket.create_connection((host, port), timeout=10)
        opened.append(scoring)
        body = _good_body()
        head = f"POST /score/test_slow HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n\r\n"
        scoring.sendall(head.encode() + body)
        calls = lambda: _get_json(f"{srv.url}/info")["stats"]["test_slow"]["model_calls"]  # noqa: E731
        assert _wait_for(lambda: calls() == 1, HANG_S), "the slow model call did not start"
        info = _get_json(f"{srv.url}/info")
        assert (info["reading"], info["in_flight"]) == (1, 1), f"the upload and the call are pending: {info}"
        srv.proc.send_signal(signal.SIGINT)  # type: ignore[union-attr]
        try:
            code = srv.proc.wait(timeout=HANG_S)  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server was still running {HANG_S:g} s after SIGINT")
        assert code == 0, "".join(srv.output)[-2000:]
        assert _wait_for(lambda: any("reward server stopped" in line for line in srv.output), HANG_S)
        answer = _read_until_closed(scoring)
        assert answer.startswith(b"HTTP/1.1 503") and b'"kind": "stopping"' in answer, answer[:300]
    finally:
        idle.close()
        for sock in opened:
            sock.close()
        srv.kill()


def _refused(host: str, port: int) -> bool:
    """Whether the server no longer accepts connections (it has started stopping)."""
    try:
        socket.create_connection((host, port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_request_scored_within_the_shutdown_grace_is_still_answered() -> None:
    """Ctrl-C while a request is inside its model call (held by the test's gate): the server stops
    listening, the gate opens only then, the request is answered 200, and the server stops once it
    is, long before its 600 s grace would have ended."""
    gated = _Gated()
    settings = ServeSettings(port=0, max_wait_ms=0, shutdown_timeout_s=float(LONG_S))
    answers: list[tuple[int, dict]] = []
    opened_after_stop: list[bool] = []

    def open_once_stopping(host: str, port: int) -> None:
        opened_after_stop.append(_wait_for(lambda: _refused(host, port), HANG_S))
        gated.release.set()

    with _in_process_server(settings, {"test_gated": gated}) as url:
        client = threading.Thread(
            target=lambda: answers.append(_post(url + "/score/test_gated", _good_body()))
        )
        client.start()
        assert gated.called.wait(HANG_S), "the model call did not start"
        opener = threading.Thread(target=open_once_stopping, args=_host_port(url))
        opener.start()
    opener.join(timeout=HANG_S)
    client.join(timeout=HANG_S)
    assert opened_after_stop == [True], "the server never stopped listening"
    assert answers == [(200, {"scores": [1.0], "components": {}})]


# ---------------------------------------------------------------------------------------------------------
# 3. Tokens


@pytest.mark.parametrize(
    "token", ["", " ", "   \t", " s3cret-token", "s3cret-token\n", "s3cret token", "sécret-token"]
)
def test_blank_or_whitespace_tokens_are_refused(token: str) -> None:
    with pytest.raises(ValueError, match="token") as caught:
        ServeSettings(token=token).check()
    assert "ODRL_REWARD_TOKEN" in str(caught.value), "the message must say how to set a token"


def test_a_good_token_is_accepted() -> None:
    ServeSettings(host="0.0.0.0", token="s3cret-token_1.2~3").check()


@pytest.mark.slow  # `odrl serve-reward` itself (in this process: it refuses before loading a reward)
def test_serve_reward_refuses_a_whitespace_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MY_TOKEN", " ")
    code, out, err = odrl_main(
        capsys, "serve-reward", "color_match", "--port", "0", "--token-env", "MY_TOKEN"
    )
    assert code == 2, out[-2000:] + err[-2000:]
    assert "MY_TOKEN" in err and "whitespace" in err, err[-2000:]


@pytest.mark.parametrize(
    ("field", "value"),
    [("read_timeout_s", 0.0), ("keepalive_timeout_s", -1.0), ("shutdown_timeout_s", float("nan"))],
)
def test_timeouts_must_be_positive(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ServeSettings(**{field: value}).check()


# ---------------------------------------------------------------------------------------------------------
# 4. Absurd media metadata and empty dimensions


AUDIO = {"audio": torch.zeros(2, 1, 8)}
VIDEO = {"video": torch.zeros(2, 2, 3, 4, 4)}


@pytest.mark.parametrize(
    ("tensors", "meta", "field"),
    [
        (AUDIO, {"sample_rate": "1" + "0" * 30}, "sample_rate"),
        (AUDIO, {"sample_rate": "1e30"}, "sample_rate"),
        (AUDIO, {"sample_rate": "0"}, "sample_rate"),
        (AUDIO, {"sample_rate": "-16000"}, "sample_rate"),
        (AUDIO, {"sample_rate": "nan"}, "sample_rate"),
        (AUDIO, {"sample_rate": "16000.5"}, "sample_rate"),
        (AUDIO, {"fps": "1e30"}, "fps"),
        (AUDIO, {"fps": "0"}, "fps"),
        (AUDIO, {"fps": "-8"}, "fps"),
        (AUDIO, {"fps": "nan"}, "fps"),
        (AUDIO, {"fps": "inf"}, "fps"),
        (AUDIO, {"fps": "eight"}, "fps"),
        ({"audio": torch.zeros(2, 0, 8)}, {}, "audio"),
        ({"audio": torch.zeros(2, 1, 0)}, {}, "audio"),
        ({"video": torch.zeros(2, 0, 3, 4, 4)}, {}, "video"),
        ({"video": torch.zeros(2, 2, 3, 0, 4)}, {}, "video"),
        ({"video": torch.zeros(2, 2, 3, 4, 0)}, {}, "video"),
    ],
    ids=lambda v: "-".join(f"{k}={str(x)[:8]}" for k, x in v.items()) if isinstance(v, dict) else None,
)
def test_absurd_rates_and_empty_dimensions_get_400_naming_the_field(
    quick_server: str, tensors: dict[str, torch.Tensor], meta: dict[str, str], field: str
) -> None:
    code, answer = _post(quick_server + SCORE_PATH, _payload(tensors, ["a", "b"], **meta))
    assert code == 400, answer
    assert f"'{field}'" in answer["error"], answer


@pytest.mark.parametrize(
    ("tensors", "meta"),
    [
        (AUDIO, {"sample_rate": "1"}),
        (AUDIO, {"sample_rate": "1000000", "fps": "1000"}),
        (AUDIO, {"sample_rate": "48000.0", "fps": "0.5"}),
        (VIDEO, {}),
    ],
)
def test_rates_at_the_bounds_are_accepted(
    quick_server: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> None:
    code, answer = _post(quick_server + SCORE_PATH, _payload(tensors, ["a", "bb"], **meta))
    assert code == 200 and answer["scores"] == [1.0, 2.0], answer


# ---------------------------------------------------------------------------------------------------------
# 5. The client: a server that is down, a url with a path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_that_is_down_gives_an_error_naming_the_url_the_rewards_and_the_fix() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    audio = MediaBatch(audio=torch.zeros(1, 1, 8))
    client = RemoteReward(url, "color_match", retries=1, backoff_s=0.01)
    with pytest.raises(RewardServerError) as caught:
        client.score(audio, ["a"])
    client.close()
    message = str(caught.value)
    assert url in message and "'color_match'" in message and "odrl serve-reward color_match" in message
    assert "failed 2 times" in message

    probe = RemoteReward(url, "", retries=0, wanted=["color_match", "pitch_match"])
    with pytest.raises(RewardServerError) as caught:
        probe.info()
    probe.close()
    message = str(caught.value)
    assert "reward ''" not in message and url in message
    assert "odrl serve-reward color_match pitch_match" in message, message

    weights = "reward.weights={color_match: 1.0, pitch_match: 1.0}"
    cfg = load_config(None, [weights, f"reward.url={url}", "reward.request_retries=0"]).reward
    with pytest.raises(RewardServerError) as caught:
        reward_from_config(cfg)
    message = str(caught.value)
    assert "reward ''" not in message and "('')" not in message, message
    assert url in message and "odrl serve-reward" in message, message


@pytest.mark.parametrize(
    "suffix", ["/score", "/score/test_prompt_length", "/api/", "?x=1", "#top"], ids=lambda s: s.strip("/?#")
)
def test_a_url_with_a_path_is_refused_when_the_client_is_made(quick_server: str, suffix: str) -> None:
    with pytest.raises(ValueError, match=r"scheme://host:port") as caught:
        RemoteReward(quick_server + suffix, "test_prompt_length")
    assert quick_server + suffix in str(caught.value)
    assert isinstance(caught.value, RewardServerError), "odrl must print it as an error, not a traceback"


def test_a_url_with_only_a_trailing_slash_is_fine(quick_server: str) -> None:
    client = RemoteReward(quick_server + "/", "test_prompt_length")
    try:
        assert client.url == quick_server
        assert client.score(MediaBatch(audio=torch.zeros(1, 1, 8)), ["abcd"]).scores.tolist() == [4.0]
    finally:
        client.close()


@pytest.mark.parametrize("url", ["http://:8400", "http://", "ftp://127.0.0.1:8400", "127.0.0.1:8400"])
def test_a_url_without_a_host_or_with_another_scheme_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="reward server url"):
        RemoteReward(url, "test_prompt_length")
