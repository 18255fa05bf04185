"""Reward servers as real child processes on 127.0.0.1: batching, wire checks, tokens, timeouts, faults."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_tensors

from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import WeightedReward
from omni_diffusion_rl.reward_factory import reward_from_config
from omni_diffusion_rl.runtime.launch import launcher_command
from omni_diffusion_rl.runtime.subprocesses import run_process_tree
from omni_diffusion_rl.serving.client import RemoteReward, RewardServerError
from omni_diffusion_rl.serving.process import ServerProcess
from omni_diffusion_rl.trainers.trainer import Trainer
from omni_diffusion_rl.world import tiny_world as world
from rewards.imagebind import imagebind_available

from .helpers import ENV, REPO, fast_overrides, odrl_main, step_records, tiny_model_dir

pytestmark = pytest.mark.slow  # every test here starts a reward server or training process
needs_imagebind = pytest.mark.skipif(
    not imagebind_available() and not os.environ.get("ODRL_REQUIRE_IMAGEBIND"),
    reason="imagebind-unofficial is not installed (see rewards/imagebind.py)",
)
TINY = ["color_match", "pitch_match", "timing_match", "av_sync"]
TESTS = ["test_prompt_length", "test_fails_on_bad"]
PLUGIN = ("--plugin", "tests.plugin_rewards")
HANG_S = 60.0  # only stops a hang: no verdict depends on how fast anything is
GATED = """
import os
import time
from pathlib import Path

import torch

from omni_diffusion_rl.registry import rewards


@rewards.register("test_gated", overwrite=True)
class Gated:
    \"\"\"Answers 1.0 once every prompt's gate (a file of that name in ODRL_TEST_GATES) is open.\"\"\"

    def score(self, media, prompts):
        gates = Path(os.environ["ODRL_TEST_GATES"])
        while not all((gates / p).exists() for p in prompts):
            time.sleep(0.01)
        return torch.ones(len(prompts))
"""


def _server(*args: str, env: dict[str, str] | None = None, names: list[str] | None = None) -> ServerProcess:
    return ServerProcess(names or TINY + TESTS, *PLUGIN, *args, env={**ENV, **(env or {})}, cwd=REPO)


@pytest.fixture(scope="module")
def gates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of test_gated's gates: a request for prompt P is answered once the file P exists."""
    return tmp_path_factory.mktemp("gates")


@pytest.fixture(scope="module")
def server(gates: Path) -> ServerProcess:
    # 256 KiB requests at most: tiny-world batches must be cut into several requests by the client.
    plugin = gates.parent / "gated_reward.py"
    plugin.write_text(GATED)
    args = ("--max-request-mb", "0.25", "--max-wait-ms", "50", "--plugin", str(plugin))
    names = [*TINY, *TESTS, "test_gated", "test_fails_on_red"]
    with _server(*args, env={"ODRL_TEST_GATES": str(gates)}, names=names) as srv:
        yield srv


def _scene_media(n: int, seed: int = 0) -> tuple[MediaBatch, list[str]]:
    gen = torch.Generator().manual_seed(seed)
    prompts, video, amps = world.synthetic_clips(n, gen, label_noise=0.5)
    media = MediaBatch(
        video=video, audio=world.synthesize_audio(amps), fps=world.FPS, sample_rate=world.SAMPLE_RATE
    )
    return media, prompts


def _reward_cfg(url: str, *extra: str):  # noqa: ANN202 - a RewardConfig
    weights = "reward.weights={" + ", ".join(f"{n}: 1.0" for n in TINY) + "}"
    return load_config(None, [weights, f"reward.url={url}", *extra]).reward


def _post(url: str, body: bytes, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/vnd.safetensors"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _payload(audio: torch.Tensor, prompts: list[str]) -> bytes:
    meta = {"prompts": json.dumps(prompts), "fps": "8.0", "sample_rate": "8000"}
    return save_tensors({"audio": audio}, metadata=meta)


# ---------------------------------------------------------------------------------------------------------
# Same scores as in-process; batching


def test_served_rewards_score_exactly_like_in_process_ones(server: ServerProcess) -> None:
    media, prompts = _scene_media(24)
    local_reward = WeightedReward.from_registry(dict.fromkeys(TINY, 1.0))
    local = local_reward(media, prompts)
    remote_reward = reward_from_config(_reward_cfg(server.url))
    assert all(type(r).__name__ == "RemoteReward" for r in remote_reward.components.values())
    remote = remote_reward(media, prompts)
    assert torch.equal(remote.total, local.total)
    assert all(torch.equal(remote.parts[n], local.parts[n]) for n in TINY)
    stats = remote_reward.components["color_match"].info()["stats"]["color_match"]
    assert stats["requests"] >= 3, (
        "24 tiny-world clips (28 KB each) exceed 256 KiB: the client must cut them into requests"
    )
    assert None not in local_reward.modalities.values(), local_reward.modalities
    assert remote_reward.modalities == local_reward.modalities, (
        "what each served reward judges reaches per-modality credit through the server's /info"
    )
    remote_reward.close()


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(server: ServerProcess) -> None:
    client = RemoteReward(server.url, "test_prompt_length")
    before = client.info()["stats"]["test_prompt_length"]

    def one(i: int) -> tuple[float, float]:
        out = client.score(MediaBatch(audio=torch.full((1, 1, 8), 0.25)), ["x" * i])
        return float(out.scores[0]), float(out.components["batch"][0])

    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    assert [s for s, _ in results] == [i + 0.25 for i in range(16)]
    assert max(b for _, b in results) > 1, "concurrent requests must share model calls"
    after = client.info()["stats"]["test_prompt_length"]
    assert after["requests"] - before["requests"] == 16
    assert after["model_calls"] - before["model_calls"] < 16
    client.close()


@needs_imagebind
def test_clap_and_imagebind_score_through_a_server_like_in_process(tmp_path: Path) -> None:
    from rewards.imagebind import TINY_ARCHITECTURE, build_model
    from rewards.tiny_models import CLAP_CORPUS, save_tiny_clap

    torch.manual_seed(0)
    torch.save(build_model(TINY_ARCHITECTURE).state_dict(), tmp_path / "imagebind.pth")
    options = {
        "clap": {"checkpoint": str(save_tiny_clap(tmp_path / "clap"))},
        "imagebind": {
            "checkpoint": str(tmp_path / "imagebind.pth"),
            "architecture": TINY_ARCHITECTURE,
            "mode": "all",
        },
    }
    gen = torch.Generator().manual_seed(3)
    media = MediaBatch(
        video=torch.rand((2, 8, 3, 24, 24), generator=gen),
        audio=0.3 * torch.randn((2, 1, 16_000), generator=gen),
        fps=8.0,
        sample_rate=16_000,
    )
    prompts = CLAP_CORPUS[:2]
    local = {name: rewards.create(name, **kwargs).score(media, prompts) for name, kwargs in options.items()}
    with _server("--options", json.dumps(options), names=["clap", "imagebind"]) as srv:
        for name, expected in local.items():
            client = RemoteReward(srv.url, name)
            served = client.score(media, prompts)
            client.close()
            expected_scores = expected if isinstance(expected, torch.Tensor) else expected.scores
            torch.testing.assert_close(served.scores, expected_scores, rtol=1e-5, atol=1e-6)
            if name == "imagebind":
                assert set(served.components) == {"audio_video", "text_audio", "text_video"}
                for key, value in expected.components.items():
                    torch.testing.assert_close(served.components[key], value, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Malformed requests: 4xx with a message; the server keeps serving


@pytest.mark.parametrize(
    ("case", "status", "fragment"),
    [
        ("wrong dtype", 400, "dtype int32"),
        ("wrong rank", 400, "[B, C, S]"),
        ("nan audio", 400, "NaN/inf values in samples [1]"),
        ("empty batch", 400, "empty"),
        ("prompt count", 400, "1 prompts for a batch of 2"),
        ("not safetensors", 400, "safetensors"),
        ("oversized", 413, "exceeds the server's limit"),
        ("unknown reward", 404, "does not serve reward 'nope'"),
        ("over max batch", 413, "40 samples exceed the server's max batch of 32"),
    ],
)
def test_malformed_requests_get_4xx_with_a_message(
    server: ServerProcess, case: str, status: int, fragment: str
) -> None:
    url = f"{server.url}/score/test_prompt_length"
    good = torch.zeros(2, 1, 8)
    body = {
        "wrong dtype": lambda: _payload(good.to(torch.int32), ["a", "b"]),
        "wrong rank": lambda: _payload(torch.zeros(2, 8), ["a", "b"]),
        "nan audio": lambda: _payload(torch.tensor([[[0.0] * 8], [[float("nan")] * 8]]), ["a", "b"]),
        "empty batch": lambda: _payload(torch.zeros(0, 1, 8), []),
        "prompt count": lambda: _payload(good, ["a"]),
        "not safetensors": lambda: b"\x00" * 64,
        "oversized": lambda: _payload(torch.zeros(1, 1, 300_000), ["a"]),
        "unknown reward": lambda: _payload(good, ["a", "b"]),
        "over max batch": lambda: _payload(torch.zeros(40, 1, 8), ["a"] * 40),
    }[case]()
    if case == "unknown reward":
        url = f"{server.url}/score/nope"
    code, answer = _post(url, body)
    assert code == status, answer
    assert fragment in answer["error"]
    code, answer = _post(f"{server.url}/score/test_prompt_length", _payload(good, ["a", "bb"]))
    assert code == 200 and answer["scores"] == [1.0, 2.0], "the server must go on serving"


def test_a_sample_the_served_reward_cannot_score_is_dropped_with_the_servers_reason(
    server: ServerProcess,
) -> None:
    remote = RemoteReward(server.url, "test_fails_on_bad")
    combined = WeightedReward(
        {"test_fails_on_bad": remote}, {"test_fails_on_bad": 1.0}, max_failed_fraction=0.5
    )
    result = combined(MediaBatch(audio=torch.zeros(4, 1, 8)), ["a", "bad", "c", "d"])
    assert list(result.failures) == [1]
    assert "422" in result.failures[1] and "cannot score prompt 'bad'" in result.failures[1]
    assert result.total[[0, 2, 3]].tolist() == [1.0, 1.0, 1.0]
    remote.close()


# ---------------------------------------------------------------------------------------------------------
# Tokens and binding


def test_a_token_is_enforced_when_set() -> None:
    with _server(names=["test_prompt_length"], env={"ODRL_REWARD_TOKEN": "s3cret"}) as srv:
        body = _payload(torch.zeros(1, 1, 8), ["abc"])
        assert _post(f"{srv.url}/score/test_prompt_length", body)[0] == 401
        code, answer = _post(f"{srv.url}/score/test_prompt_length", body, token="wrong")
        assert code == 401 and "wrong bearer token" in answer["error"]
        assert _post(f"{srv.url}/score/test_prompt_length", body, token="s3cret") == (
            200,
            {"scores": [3.0], "components": {"batch": [1.0]}},
        )
        with urllib.request.urlopen(f"{srv.url}/health", timeout=10) as resp:
            assert json.loads(resp.read()) == {"status": "ok"}
        client = RemoteReward(srv.url, "test_prompt_length", token="", retries=0)
        client.token = None
        with pytest.raises(RewardServerError, match="401.*ODRL_REWARD_TOKEN"):
            client.score(MediaBatch(audio=torch.zeros(1, 1, 8)), ["abc"])
        client.close()
        authorised = RemoteReward(srv.url, "test_prompt_length", token="s3cret")
        assert authorised.score(MediaBatch(audio=torch.zeros(1, 1, 8)), ["abc"]).scores.tolist() == [3.0]
        authorised.close()


def test_binding_beyond_loopback_without_a_token_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`odrl serve-reward` refuses before it loads a reward or listens: run in this process."""
    monkeypatch.delenv("ODRL_REWARD_TOKEN", raising=False)
    code, _, err = odrl_main(capsys, "serve-reward", "color_match", "--host", "0.0.0.0", "--port", "0")
    assert code == 2, err
    assert "without a token" in err and "ODRL_REWARD_TOKEN" in err, err


# ---------------------------------------------------------------------------------------------------------
# Timeouts and a server that dies


def _info_when(client: RemoteReward, done: Callable[[dict], bool], what: str) -> dict:
    """The server's /info once `done(info)` holds; a test failure naming `what` if it never does."""
    deadline = time.monotonic() + HANG_S
    info = client.info()
    while not done(info):
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: still not so after {HANG_S:g} s; /info says {info}")
        time.sleep(0.05)
        info = client.info()
    return info


def test_a_slow_server_hits_the_timeout_and_the_error_says_so(server: ServerProcess, gates: Path) -> None:
    """The server cannot answer prompt 'held' until this test opens its gate, so the client's two
    attempts both time out while the server's model call is provably still running; the retry,
    queued behind that call and abandoned by its client, is then skipped by the server."""
    held, audio = gates / "held", MediaBatch(audio=torch.zeros(1, 1, 8))
    client = RemoteReward(server.url, "test_gated", timeout_s=2.0, retries=1, backoff_s=0.1)
    before = client.info()["stats"]["test_gated"]
    opener = threading.Timer(HANG_S, held.touch)  # a client that waits for the answer gets it then
    opener.start()
    try:
        with pytest.raises(RewardServerError, match=r"failed 2 times.*no answer within timeout_s=2 s"):
            client.score(audio, ["held"])
        assert not held.exists(), "the client waited for the slow server's answer"
        # Both of the client's requests reached the server and were dropped by it once the client left:
        # nothing is in flight, one model call (the first request's) is running, the retry is queued.
        info = _info_when(client, lambda i: i["in_flight"] == 0, "the server still holds the left requests")
        stats = info["stats"]["test_gated"]
        moved = {k: stats[k] - before[k] for k in ("requests", "model_calls")}
        assert moved == {"requests": 2, "model_calls": 1}, stats
    finally:
        opener.cancel()
        held.touch()  # the first call ends; the abandoned retry comes up next in the queue
    (gates / "open").touch()
    fresh = RemoteReward(server.url, "test_gated")
    assert fresh.score(audio, ["open"]).scores.tolist() == [1.0]  # after the retry, which queued first
    after = fresh.info()["stats"]["test_gated"]
    fresh.close()
    client.close()
    moved = {k: after[k] - before[k] for k in ("requests", "model_calls", "samples")}
    assert moved == {"requests": 3, "model_calls": 2, "samples": 2}, (
        f"the abandoned retry must be skipped, not scored: {moved}"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def _served_run(model_dir: Path, out: Path, url: str, steps: int, *extra: str) -> Trainer:
    overrides = fast_overrides(model_dir, out, steps) + ["train.eval_at_start_and_end=false", *extra]
    if url:
        overrides += [f"reward.url={url}"]
    trainer = Trainer(load_config(None, overrides))
    trainer.fit()
    return trainer


def _kill_after_first_step(srv: ServerProcess, run: Path, restart_after_s: float | None) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.02)
        srv.kill()
        if restart_after_s is not None:
            time.sleep(restart_after_s)
            srv.proc = None
            srv.start()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_run_survives_its_reward_server_being_killed_and_restarted_and_stops_when_it_stays_down(
    model_dir: Path, tmp_path: Path
) -> None:
    """One server, two runs. The first (the tiny rewards) sees it killed after its first step and
    restarted a second later: it matches the run scoring in process. The second also asks
    test_dies_after, which crashes the (restarted) server (exits 17) in its second call, step 2's
    scoring (one call a step): the run stops there, in that step, after the one retry it was allowed."""
    reference = tmp_path / "in_process"
    _served_run(model_dir, reference, "", 4)
    names = [*TINY, "test_dies_after"]
    with _server(names=names, env={"ODRL_TEST_DIE_AFTER": "2"}) as srv:
        port = srv.url.rsplit(":", 1)[1]
        srv.command[srv.command.index("--port") + 1] = port  # come back on the same address
        run = tmp_path / "served"
        watcher = _kill_after_first_step(srv, run, restart_after_s=1.0)
        _served_run(model_dir, run, srv.url, 4, "reward.request_retries=6")
        watcher.join(timeout=60)
        assert len([line for line in srv.output if '"event": "ready"' in line]) == 2, (
            "the server was restarted"
        )
        served, local = step_records(run), step_records(reference)
        assert len(served) == len(local) == 4
        for a, b in zip(served, local, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key

        weights = "reward.weights={" + ", ".join(f"{n}: 1.0" for n in names) + "}"
        down = tmp_path / "down"
        with pytest.raises(RewardServerError, match=r"failed 2 times.*Is `odrl serve-reward .*` running"):
            _served_run(model_dir, down, srv.url, 50, "reward.request_retries=1", weights)
        assert srv.proc is not None and srv.proc.wait(timeout=HANG_S) == 17, "the server died in its call"
    assert [r["step"] for r in step_records(down)] == [1], "stopped in step 2, the first without a server"
    assert not (down / "checkpoints" / "step_0000050").exists()


def test_two_processes_with_a_process_left_without_samples_match_one(
    server: ServerProcess, model_dir: Path, tmp_path: Path
) -> None:
    """One prompt group per process, one group unscorable: that process trains nothing, joins the
    gradient average with weight 0, and the run equals a single process's (both scored by the
    module's server; a request whose batch fails is answered alone)."""
    red = next(s.prompt for s in world.ALL_SCENES if s.color == "red")
    blue = next(s.prompt for s in world.ALL_SCENES if s.color == "blue")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{red}\n{blue}\n")
    extra = [
        f"data.prompts={prompts}",
        "reward.weights={color_match: 1.0, test_fails_on_red: 1.0}",
        f"reward.url={server.url}",
        "reward.max_failed_fraction=0.5",
        "train.eval_at_start_and_end=false",
    ]
    single = tmp_path / "single"
    Trainer(load_config(None, fast_overrides(model_dir, single, 2) + extra)).fit()
    double = tmp_path / "double"
    proc = run_process_tree(
        launcher_command(2, ["train", *fast_overrides(model_dir, double, 2), *extra]),
        timeout_s=300,
        env={**ENV, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"},
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows_1, rows_2 = step_records(single), step_records(double)
    assert len(rows_1) == len(rows_2) == 2
    for a, b in zip(rows_1, rows_2, strict=True):
        assert b["samples/trained"] + b["samples/dropped/reward_failed"] == b["samples/generated"]
        for key in (
            "reward/mean",
            "samples/trained",
            "samples/dropped/reward_failed",
            "loss/total",
            "grad_norm",
        ):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    logged = [
        json.loads(line)
        for path in double.glob("failed_samples*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert len(logged) == 4 and {r["prompt"] for r in logged} == {red}
