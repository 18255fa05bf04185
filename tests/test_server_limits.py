"""Servers bounded in work, not only bytes (GitHub issue 24, the server parts).

The attacker's cases (a prompt that froze the tiny world's regex, frames that took the process to
23 GB) now get a 4xx sentence and the server keeps answering /health; prompts are parsed in linear
time, exactly as the regexes they replace parse the real prompt sets; requests beyond a reward's
declared input limits are refused from their header alone; a malformed Authorization header is a
401 and a wrong Content-Type a 415. Everything is verified by status codes and counts, never by a
wall-clock verdict (the RSS bound is checked by `odrl bench reward-server`).

Servers run on 127.0.0.1 at a free port: in this process (an event loop on a thread) for rewards the
test controls, and one `odrl serve-reward` child process (marked slow) for the attacker's exact cases.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_tensors

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.prompts import load_prompts
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import InputLimits
from omni_diffusion_rl.serving.client import RemoteReward
from omni_diffusion_rl.serving.process import ServerProcess
from omni_diffusion_rl.serving.server import ServeSettings, serve
from omni_diffusion_rl.serving.teacher_client import RemoteTeacher
from omni_diffusion_rl.serving.teacher_wire import encode_states
from omni_diffusion_rl.serving.wire import CONTENT_TYPE, MAX_PROMPT_CHARS, encode_media
from omni_diffusion_rl.teacher import CONVENTION, TeacherInfo
from omni_diffusion_rl.world import avqa, tiny_world
from rewards.avqa import is_description

from .helpers import ENV, REPO

TINY = ["color_match", "shape_match", "clean_background", "avqa_exact", "answer_format"]
RECIPE_PROMPTS = sorted((REPO / "recipes" / "prompts").glob("*.txt"))

# ---------------------------------------------------------------------------------------------------------
# The parsers: exactly what the regexes they replace accepted

# The regexes as they were (the reference): tiny_world._PROMPT_RE and rewards/avqa.py's _DESCRIPTION.
OLD_PROMPT_RE = re.compile(
    rf"\b(?P<color>{'|'.join(tiny_world.COLORS)})\b.*\b(?P<shape>{'|'.join(tiny_world.SHAPES)})\b"
    rf".*\b(?P<pitch>{'|'.join(tiny_world.PITCH_BINS)}) tone\b.*\b(?P<when>start|end)\b"
)
OLD_DESCRIPTION_RE = re.compile(
    rf"^a ({'|'.join(tiny_world.COLORS)}) ({'|'.join(tiny_world.SHAPES)}) with a "
    rf"({'|'.join(tiny_world.PITCH_BINS)}) tone at the (start|end)$"
)


def old_parse_prompt(prompt: str) -> tiny_world.Scene | None:
    m = OLD_PROMPT_RE.search(prompt.lower())
    if m is None:
        return None
    return tiny_world.Scene(m["color"], m["shape"], m["pitch"], "early" if m["when"] == "start" else "late")


def old_parse_question(prompt: str) -> avqa.Question | None:
    kind, sep, scene_text = prompt.partition(" | ")
    scene = old_parse_prompt(scene_text) if sep else None
    if kind not in avqa.QUESTION_KINDS or scene is None or scene.prompt != scene_text.strip():
        return None
    return avqa.Question(scene, kind)


def new_parse_question(prompt: str) -> avqa.Question | None:
    try:
        return avqa.parse_question(prompt)
    except ValueError:
        return None


def _variants(text: str) -> list[str]:
    """`text` and what a user might write instead: other case, spacing, lines, words around it."""
    return [
        text,
        text.upper(),
        text.title(),
        f"  {text}\n",
        f"\n{text}",
        text.replace(" ", "  "),
        text.replace(" tone", "\ntone"),
        text.replace("a ", "a_", 1),
        f"photo: {text}, please",
        f"{text} {text}",
        text.replace("circle", "circles").replace("square", "squares"),
        " ".join(reversed(text.split())),
    ]


def _prompt_corpus() -> list[str]:
    """Every prompt the project ships (recipes/prompts/*.txt, the world's scenes and splits, the
    AVQA questions, their text, answers and scene parts), each with its variants."""
    prompts: list[str] = []
    for path in RECIPE_PROMPTS:
        prompts += path.read_text(encoding="utf-8").splitlines()  # comments too: they are text
        prompts += load_prompts(str(path))
    prompts += (
        [s.prompt for s in tiny_world.ALL_SCENES] + tiny_world.TRAIN_PROMPTS + tiny_world.HELDOUT_PROMPTS
    )
    questions = avqa.questions(False) + avqa.questions(True)
    prompts += avqa.TRAIN_QUESTIONS + avqa.HELDOUT_QUESTIONS
    prompts += [q.text for q in questions] + [q.answer for q in questions]
    return [v for p in dict.fromkeys(prompts) for v in _variants(p)]


def test_the_shipped_prompt_sets_are_in_the_corpus() -> None:
    assert len(RECIPE_PROMPTS) >= 2, "recipes/prompts/*.txt"
    corpus = set(_prompt_corpus())
    assert set(load_prompts(str(RECIPE_PROMPTS[0]))) <= corpus
    assert set(tiny_world.TRAIN_PROMPTS + avqa.HELDOUT_QUESTIONS) <= corpus


def test_tiny_world_prompts_parse_exactly_as_with_the_old_regex() -> None:
    corpus = _prompt_corpus()
    for prompt in corpus:
        assert tiny_world.parse_prompt(prompt) == old_parse_prompt(prompt), repr(prompt)
    parsed = sum(tiny_world.parse_prompt(p) is not None for p in corpus)
    assert parsed > len(tiny_world.ALL_SCENES) * 5, "the corpus must exercise accepted prompts too"


def test_avqa_questions_parse_exactly_as_before() -> None:
    corpus = _prompt_corpus() + [f"{k} | {p}" for k in avqa.QUESTION_KINDS for p in _prompt_corpus()[:400]]
    for prompt in corpus:
        assert new_parse_question(prompt) == old_parse_question(prompt), repr(prompt)
    assert all(new_parse_question(q) is not None for q in avqa.TRAIN_QUESTIONS + avqa.HELDOUT_QUESTIONS)


def test_answer_format_checks_descriptions_exactly_as_before() -> None:
    texts = [avqa.normalise_answer(t) for t in _prompt_corpus()]
    for text in texts:
        assert is_description(text) == bool(OLD_DESCRIPTION_RE.match(text)), repr(text)
    assert sum(map(is_description, texts)) >= len(tiny_world.ALL_SCENES)


def test_answers_normalise_exactly_as_before() -> None:
    """ASCII text normalises as the old regex did; other scripts keep their letters and digits
    (NFKC, case-folded) instead of being erased, so an answer in them can be graded."""
    for text in _prompt_corpus() + ["A red, CIRCLE!", "a\tb\n c", "x_y-z 9"]:
        expected = " ".join(re.sub(r"[^a-z0-9 ]+", " ", text.lower()).split())
        assert avqa.normalise_answer(text) == expected, repr(text)
    assert avqa.normalise_answer("Á red, CIRCLE!") == "á red circle"
    assert avqa.normalise_answer("x_y-z 9 ½ ²") == "x y z 9 1 2 2"  # NFKC: 1⁄2 and 2
    assert avqa.normalise_answer("猫!") == "猫" and avqa.normalise_answer("?!") == ""


_WORDS = [*tiny_world.COLORS, *tiny_world.SHAPES, *tiny_world.PITCH_BINS, "tone", "start", "end", "a", "Red"]
_GLUE = [" ", "  ", "\n", "\t", "_", "-", ",", "x", "é", "1", "", " tone ", "TONE"]


@settings(max_examples=400, deadline=None, database=None)
@given(st.lists(st.sampled_from(_WORDS) | st.sampled_from(_GLUE), max_size=24))
def test_prompt_parser_agrees_with_the_old_regex_on_generated_text(parts: list[str]) -> None:
    """Text made of the world's words and every kind of separator (short enough for the old
    regex to finish): the same scene, or None, from both."""
    prompt = "".join(parts)
    assert tiny_world.parse_prompt(prompt) == old_parse_prompt(prompt)
    assert new_parse_question(f"describe | {prompt}") == old_parse_question(f"describe | {prompt}")


def test_the_attackers_prompts_are_parsed_to_an_end() -> None:
    """The prompts that took the old regexes 9.4 s (8,000 characters), more than 60 s (1 MB) and 24 s
    (AVQA): refused, in linear time (no timing asserted: a regression would hang the test)."""
    assert tiny_world.parse_prompt("red circle " * 730) is None
    assert tiny_world.parse_prompt("red circle " * 100_000) is None
    assert tiny_world.parse_prompt("red circle high tone " * 50_000 + "at the end") == tiny_world.Scene(
        "red", "circle", "high", "late"
    )
    with pytest.raises(ValueError, match="not a tiny AVQA prompt"):
        avqa.parse_question("describe | " + "red circle " * 1000)


# ---------------------------------------------------------------------------------------------------------
# Servers in this process


class Gate:
    """A reward that scores 1.0 once `release` is set, saying (`entered`) when a call has started."""

    input_limits = InputLimits(
        frames=2, frame_height=32, frame_width=24, audio_samples=64, meant_for="the gate's test clips"
    )

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        self.calls += 1
        self.entered.set()
        if not self.release.wait(60):
            raise RuntimeError("the test never released the gate")
        return torch.ones(len(prompts))


class Undeclared:
    """A reward that declares no input limits (the server's defaults apply)."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        return torch.full((len(prompts),), 2.0)


class HalfTeacher:
    """A teacher whose velocity is half the state."""

    def info(self) -> TeacherInfo:
        return TeacherInfo((6,), "test:6", CONVENTION, "half")

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return 0.5 * x_t.float()


@contextmanager
def served(scorers: dict[str, Any], teachers: dict[str, Any] | None = None, **options: Any) -> Iterator[str]:
    """`serve()` on its own event loop and thread at a free 127.0.0.1 port; yields its url."""
    settings = ServeSettings(port=0, max_wait_ms=0, shutdown_timeout_s=0.5, **options)
    loop = asyncio.new_event_loop()
    urls: list[str] = []
    started = threading.Event()

    def ready(url: str) -> None:
        urls.append(url)
        started.set()

    task = loop.create_task(serve(scorers, settings, ready=ready, teachers=teachers))
    thread = threading.Thread(target=lambda: _run_until_done(loop, task, started), daemon=True)
    thread.start()
    try:
        assert started.wait(30) and urls, "the in-process server did not start"
        yield urls[0]
    finally:
        for scorer in scorers.values():
            if isinstance(scorer, Gate):
                scorer.release.set()
        loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=20)
        assert not thread.is_alive(), "the in-process server did not stop"


def _run_until_done(
    loop: asyncio.AbstractEventLoop, task: asyncio.Task[None], started: threading.Event
) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(task)
    except (asyncio.CancelledError, Exception):
        started.set()
    finally:
        loop.close()


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _request(
    url: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str | bytes] | None = None,
    method: str = "POST",
) -> tuple[int, dict[str, Any]]:
    """Status and answer (JSON, or {"body": bytes}); header values may be raw bytes (non-ASCII,
    invalid UTF-8), and a None value leaves the header out."""
    conn = http.client.HTTPConnection(*_address(url), timeout=60)
    try:
        conn.putrequest(method, path)
        sent = {"Content-Type": CONTENT_TYPE, **(headers or {})}
        for key, value in sent.items():
            if value is not None:
                conn.putheader(key, value)
        if method == "POST":
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body if method == "POST" else None)
        answer = conn.getresponse()
        data = answer.read()
        if (answer.getheader("Content-Type") or "").startswith("application/json"):
            return answer.status, json.loads(data)
        return answer.status, {"body": data}
    finally:
        conn.close()


def _health(url: str) -> int:
    return _request(url, "/health", method="GET")[0]


def _media_body(
    video: tuple[int, ...] | None, audio: tuple[int, ...] | None, prompts: list[str], **extra: Any
) -> bytes:
    tensors = {}
    if video is not None:
        tensors["video"] = torch.zeros(video, dtype=torch.float16)
    if audio is not None:
        tensors["audio"] = torch.zeros(audio, dtype=torch.float16)
    meta = {"prompts": json.dumps(prompts), "fps": "8.0", "sample_rate": "8000", **extra}
    return save_tensors(tensors, metadata=meta)


def _header_only(
    url: str, path: str, body: bytes, content_length: int | None = None
) -> tuple[int, dict[str, Any], int]:
    """POST `body`'s safetensors header alone (its Content-Length says the whole body, or
    `content_length`): the answer, and how many bytes of the body were sent. Only a server that
    decides from the header answers."""
    prefix = body[: 8 + int.from_bytes(body[:8], "little")]
    host, port = _address(url)
    with socket.create_connection((host, port), timeout=30) as sock:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
            f"Content-Length: {len(body) if content_length is None else content_length}\r\n\r\n"
        )
        sock.sendall(head.encode() + prefix)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536) or b"<closed>"
        status_line, rest = data.split(b"\r\n", 1)
        headers, answer = rest.split(b"\r\n\r\n", 1)
        length = int(re.search(rb"(?i)content-length: *(\d+)", headers).group(1))  # type: ignore[union-attr]
        while len(answer) < length:
            answer += sock.recv(65536)
    return int(status_line.split()[1]), json.loads(answer), len(prefix)


def _post_chunked(url: str, path: str, body: bytes) -> bytes:
    """POST `body` as one chunk of a chunked body: the raw reply (the server answers, then closes)."""
    host, port = _address(url)
    with socket.create_connection((host, port), timeout=30) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\n"
        sock.sendall(head.encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


async def _post_whole(url: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST the whole body with aiohttp (the project's clients' library): what such a client reads."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, data=body, headers={"Content-Type": CONTENT_TYPE}) as answer:
            return answer.status, json.loads(await answer.read())


@pytest.fixture(scope="module")
def tiny_url() -> Iterator[str]:
    with served({name: rewards.create(name) for name in TINY}) as url:
        yield url


def _attack(case: str) -> tuple[str, bytes]:
    """The attacker's requests from issue 24 (path, body)."""
    clip = {"video": (1, 4, 3, 16, 16), "audio": (1, 1, 4000)}
    if case == "1 MB prompt":
        return "/score/color_match", _media_body(**clip, prompts=["red circle " * 95_000])
    if case == "8,000-character prompt":
        return "/score/color_match", _media_body(**clip, prompts=["red circle " * 730])
    if case == "AVQA describe prompt":
        body = _media_body(**clip, prompts=["describe | " + "red circle " * 1000], text=json.dumps(["a"]))
        return "/score/avqa_exact", body
    if case == "2048 x 2048 frames":
        return "/score/clean_background", _media_body((1, 2, 3, 2048, 2048), None, ["a red circle"])
    return "/score/shape_match", _media_body((1, 2, 3, 1024, 1024), None, ["a red circle"])


ATTACKS = {
    "1 MB prompt": (400, ["16384", "1045000 characters"]),
    "8,000-character prompt": (422, ["is not a tiny-world prompt"]),
    "AVQA describe prompt": (422, ["is not a tiny AVQA prompt"]),
    "2048 x 2048 frames": (413, ["2048 x 2048", "at most 16 x 16", "tiny world's clips"]),
    "1024 x 1024 frames": (413, ["1024 x 1024", "at most 16 x 16"]),
}


@pytest.mark.parametrize("case", list(ATTACKS))
def test_the_attackers_requests_get_a_4xx_sentence_and_the_server_goes_on(tiny_url: str, case: str) -> None:
    path, body = _attack(case)
    status, fragments = ATTACKS[case]
    code, answer = asyncio.run(_post_whole(tiny_url, path, body))
    assert code == status, answer
    assert all(f in answer["error"] for f in fragments), answer["error"]
    assert _health(tiny_url) == 200
    good = encode_media(_tiny_clips(2), [tiny_world.ALL_SCENES[0].prompt] * 2)
    assert _request(tiny_url, "/score/color_match", good)[0] == 200


def _tiny_clips(n: int) -> MediaBatch:
    prompts, video, amps = tiny_world.synthetic_clips(n, torch.Generator().manual_seed(0))
    return MediaBatch(
        video=video, audio=tiny_world.synthesize_audio(amps), fps=tiny_world.FPS, sample_rate=8000
    )


@pytest.mark.parametrize("case", ["2048 x 2048 frames", "1024 x 1024 frames"])
def test_frames_beyond_the_limit_are_refused_from_the_header_alone(tiny_url: str, case: str) -> None:
    """The answer comes before the body is sent: the 48 MB of frames never reach the server."""
    path, body = _attack(case)
    code, answer, sent = _header_only(tiny_url, path, body)
    assert code == 413 and "at most 16 x 16" in answer["error"], answer
    assert sent < 1000 < len(body)
    info = _request(tiny_url, "/info", method="GET")[1]
    assert info["reading"] == 0 and info["in_flight"] == 0, info


@pytest.mark.parametrize("extra", [250 << 20, -1], ids=["250 MB of padding", "a byte short"])
def test_a_body_of_another_length_than_its_header_declares_is_refused_from_the_header(
    tiny_url: str, extra: int
) -> None:
    """A valid header whose Content-Length says 250 MB more than the payload it declares (padding
    after it), or a byte less, is answered once the header has arrived: the padding is never sent,
    so it is never received or held."""
    body = encode_media(_tiny_clips(1), [tiny_world.ALL_SCENES[0].prompt])
    code, answer, sent = _header_only(tiny_url, "/score/color_match", body, len(body) + extra)
    assert code == 400 and sent < len(body), answer
    assert f"the body is {len(body) + extra} bytes" in answer["error"], answer
    assert f"declares a payload of {len(body)} bytes" in answer["error"], answer
    info = _request(tiny_url, "/info", method="GET")[1]
    assert info["reading"] == 0 and info["in_flight"] == 0, info


def test_a_chunked_body_that_goes_on_past_its_payload_is_refused(tiny_url: str) -> None:
    body = encode_media(_tiny_clips(1), [tiny_world.ALL_SCENES[0].prompt]) + b"padding"
    reply = _post_chunked(tiny_url, "/score/color_match", body)
    assert reply.startswith(b"HTTP/1.1 400") and b"the chunked body goes on" in reply, reply[:300]
    assert _health(tiny_url) == 200


def test_health_answers_during_the_attack(tiny_url: str) -> None:
    """Every attack at once from 10 threads, twice each, while /health is asked over and over."""
    outcomes: list[tuple[str, int]] = []
    health: list[int] = []
    done = threading.Event()

    def attacker(case: str) -> None:
        for _ in range(2):
            outcomes.append((case, asyncio.run(_post_whole(tiny_url, *_attack(case)))[0]))

    def watch() -> None:
        while not done.wait(0.05):
            health.append(_health(tiny_url))

    threads = [threading.Thread(target=attacker, args=(c,)) for c in [*ATTACKS, *ATTACKS]]
    watcher = threading.Thread(target=watch)
    for thread in [*threads, watcher]:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    done.set()
    watcher.join(timeout=30)
    assert sorted(outcomes) == sorted((c, ATTACKS[c][0]) for c in [*ATTACKS, *ATTACKS] for _ in range(2))
    assert health and set(health) == {200}, health


def test_health_and_other_rewards_answer_while_a_maximal_legal_request_is_scored() -> None:
    gate = Gate()
    with served({"gate": gate, "other": Undeclared()}, max_batch=3) as url:
        limits = gate.input_limits
        largest = _media_body(
            (3, limits.frames, 3, limits.frame_height, limits.frame_width),
            (3, 2, limits.audio_samples // 2),
            ["p" * MAX_PROMPT_CHARS] * 3,
        )
        answers: list[tuple[int, dict[str, Any]]] = []
        scoring = threading.Thread(target=lambda: answers.append(_request(url, "/score/gate", largest)))
        scoring.start()
        assert gate.entered.wait(30), "the gate's model call did not start"
        assert _health(url) == 200
        info = _request(url, "/info", method="GET")[1]
        assert info["in_flight"] == 1 and info["stats"]["gate"]["model_calls"] == 1, info
        assert _request(url, "/score/other", _media_body(None, (1, 1, 8), ["a"])) == (
            200,
            {"scores": [2.0], "components": {}},
        )
        too_wide = _media_body((1, 1, 3, limits.frame_height, limits.frame_width + 1), None, ["a"])
        code, answer = _request(url, "/score/gate", too_wide)
        assert code == 413 and "32 x 25 pixels" in answer["error"] and "at most 32 x 24" in answer["error"]
        code, answer = _request(
            url, "/score/gate", _media_body(None, (1, 1, 8), ["p" * (MAX_PROMPT_CHARS + 1)])
        )
        assert code == 400 and f"{MAX_PROMPT_CHARS + 1} characters" in answer["error"], answer
        assert not answers and gate.calls == 1, "refusals must not wait for, or reach, the busy model"
        gate.release.set()
        scoring.join(timeout=30)
    assert answers == [(200, {"scores": [1.0, 1.0, 1.0], "components": {}})]


def test_a_requests_pixels_and_audio_are_bounded_by_max_batch_of_the_largest_samples() -> None:
    gate = Gate()
    gate.release.set()
    limits = gate.input_limits
    h, w = limits.frame_height, limits.frame_width
    cases = [  # (video, audio, expected status, fragment of the refusal)
        ((1, 2 * limits.frames, 3, h, w), None, 200, ""),  # one long sample: the budget of two
        ((1, 2 * limits.frames + 1, 3, h, w), None, 413, f"takes at most {2 * limits.pixels} per request"),
        ((2, limits.frames, 3, h, w), None, 200, ""),
        ((3, 1, 3, 4, 4), None, 413, "3 samples exceed the server's max batch of 2"),
        ((1, 1, 3, h + 1, w), None, 413, f"at most {h} x {w}"),
        (None, (1, 1, 2 * limits.audio_samples), 200, ""),
        (None, (1, 2, limits.audio_samples + 1), 413, f"at most {2 * limits.audio_samples} per request"),
    ]
    with served({"gate": gate}, max_batch=2) as url:
        for video, audio, status, fragment in cases:
            batch = (video or audio)[0]  # type: ignore[index]
            code, answer = _request(url, "/score/gate", _media_body(video, audio, ["p"] * batch))
            assert code == status and fragment in answer.get("error", ""), (video, audio, answer)
        info = _request(url, "/info", method="GET")[1]
    assert info["input_limits"]["gate"]["request_pixels"] == 2 * limits.pixels
    assert info["input_limits"]["gate"]["meant_for"] == "the gate's test clips"
    assert info["max_prompt_chars"] == MAX_PROMPT_CHARS


def test_a_reward_that_declares_no_limits_gets_the_documented_defaults() -> None:
    with served({"plain": Undeclared()}) as url:
        limits = _request(url, "/info", method="GET")[1]["input_limits"]["plain"]
    assert limits["frame_height"] == limits["frame_width"] == 4096 and limits["frames"] == 2048
    assert "declares no input_limits" in limits["meant_for"]


def test_a_chunked_body_over_the_size_limit_gets_413() -> None:
    with served({"plain": Undeclared()}, max_request_mb=0.01) as url:
        body = _media_body(None, (1, 1, 8_000), ["a"])  # 16 KB of audio > 10 KB
        reply = _post_chunked(url, "/score/plain", body)
        assert reply.startswith(b"HTTP/1.1 413") and b"exceeds the server's limit" in reply, reply[:300]
        assert _health(url) == 200


# ---------------------------------------------------------------------------------------------------------
# Authorization and Content-Type


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        (None, "got no bearer token"),
        (b"Bearer \xff\xfe\x80", "outside printable ASCII"),
        ("Bearer sécret".encode(), "outside printable ASCII"),
        ("Basic czNjcmV0", "not 'Bearer <token>'"),
        ("Bearer wrong", "a wrong bearer token"),
        ("bearer s3cret-token", "not 'Bearer <token>'"),
    ],
    ids=["none", "invalid utf-8", "non-ascii", "basic", "wrong", "lower-case scheme"],
)
def test_a_missing_or_malformed_authorization_gets_401_with_a_sentence_and_no_traceback(
    given: str | bytes | None, fragment: str, caplog: pytest.LogCaptureFixture
) -> None:
    body = _media_body(None, (1, 1, 8), ["a"])
    with (
        caplog.at_level(logging.ERROR),
        served({"plain": Undeclared()}, {"policy": HalfTeacher()}, token="s3cret-token") as url,
    ):
        for path, request in [("/score/plain", body), ("/velocity/policy", _states_body(1))]:
            code, answer = _request(url, path, request, {"Authorization": given} if given is not None else {})
            assert code == 401 and fragment in answer["error"], answer
            assert answer["error"].startswith("this server needs 'Authorization: Bearer <token>'")
        assert _request(url, "/score/plain", body, {"Authorization": "Bearer s3cret-token"})[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [
        r.getMessage() for r in caplog.records
    ]


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/octet-stream", "text/plain; charset=utf-8"]
)
def test_a_wrong_content_type_gets_415_naming_the_expected_one(content_type: str) -> None:
    with served({"plain": Undeclared()}, {"policy": HalfTeacher()}) as url:
        for path, body in [
            ("/score/plain", _media_body(None, (1, 1, 8), ["a"])),
            ("/velocity/policy", _states_body(1)),
        ]:
            code, answer = _request(url, path, body, {"Content-Type": content_type})
            assert code == 415, answer
            assert CONTENT_TYPE in answer["error"] and content_type in answer["error"], answer


@pytest.mark.parametrize("content_type", [None, CONTENT_TYPE, "Application/VND.Safetensors; version=1"])
def test_the_safetensors_content_type_or_none_is_read(content_type: str | None) -> None:
    with served({"plain": Undeclared()}) as url:
        headers = {"Content-Type": content_type} if content_type else {"Content-Type": None}
        code, answer = _request(url, "/score/plain", _media_body(None, (1, 1, 8), ["a"]), headers)  # type: ignore[dict-item]
    assert code == 200, answer


def test_the_projects_own_clients_are_answered() -> None:
    with served({"plain": Undeclared()}, {"policy": HalfTeacher()}) as url:
        reward = RemoteReward(url, "plain", retries=0)
        try:
            assert reward.score(MediaBatch(audio=torch.zeros(2, 1, 8)), ["a", "b"]).scores.tolist() == [
                2.0,
                2.0,
            ]
        finally:
            reward.close()
        teacher = RemoteTeacher([url], retries=0)
        try:
            x = torch.randn(3, 6)
            torch.testing.assert_close(teacher.velocity(x, torch.rand(3), ["a"] * 3), 0.5 * x)
        finally:
            teacher.close()


# ---------------------------------------------------------------------------------------------------------
# The teacher server's limits


def _states_body(n: int, prompt: str = "a") -> bytes:
    return encode_states(torch.zeros(n, 6), torch.full((n,), 0.5), [prompt] * n)


def test_the_teacher_server_bounds_prompts_and_batches_from_the_header() -> None:
    with served({}, {"policy": HalfTeacher()}, max_batch=3) as url:
        code, answer = _request(url, "/velocity/policy", _states_body(1, "p" * (MAX_PROMPT_CHARS + 1)))
        assert code == 400 and f"limit of {MAX_PROMPT_CHARS}" in answer["error"], answer
        code, answer, sent = _header_only(url, "/velocity/policy", _states_body(4))
        assert code == 413 and "4 states exceed the server's max batch of 3" in answer["error"], answer
        assert _request(url, "/velocity/policy", _states_body(3))[0] == 200
        assert _health(url) == 200


# ---------------------------------------------------------------------------------------------------------
# The attacker's exact cases against `odrl serve-reward`


@pytest.mark.slow  # starts a server process
def test_the_attackers_exact_cases_against_a_served_process() -> None:
    with ServerProcess(
        ["clean_background", "shape_match", "color_match", "avqa_exact"], env=ENV, cwd=REPO
    ) as srv:
        for case, (status, fragments) in ATTACKS.items():
            code, answer = asyncio.run(_post_whole(srv.url, *_attack(case)))
            assert code == status and all(f in answer["error"] for f in fragments), (case, answer)
            assert _health(srv.url) == 200
        assert srv.proc is not None and srv.proc.poll() is None, "the server must still run"
        output = "".join(srv.output)
    assert "Traceback" not in output, output[-3000:]


def test_readme_states_the_limits() -> None:
    section = Path(REPO / "docs" / "rewards.md").read_text(encoding="utf-8").split("## Reward servers", 1)[1]
    for fact in ("input_limits", "16384", "413", "415", "401", "16 x 16"):
        assert fact in section, fact


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_wait_ms", float("nan")),  # every lone request waited out its client's timeout
        ("max_wait_ms", float("inf")),  # a lone request was never answered
        ("max_wait_ms", -1.0),
        ("max_wait_ms", 60_001.0),
        ("max_request_mb", float("nan")),
        ("max_request_mb", 0.0),
    ],
)
def test_a_server_option_that_is_not_a_finite_number_in_range_is_refused(option: str, value: float) -> None:
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ValueError, match=f"{option} \\({flag}\\) must be a number of (milliseconds|MB)"):
        ServeSettings(**{option: value}).check()
    ServeSettings(max_wait_ms=60_000.0).check()  # the bound itself serves
