"""Benchmark: a reward server's batching and its client overhead, on a tiny random-init CLAP model.

* Throughput: 32 concurrent clients each send one 1 s 48 kHz clip per request, to a server that
  batches (max batch 32) and to the same server with max batch 1; samples scored per second.
* Overhead: one batch of 16 one-second 48 kHz clips scored in-process (`ClapReward.score`) and
  through the server (`RemoteReward.score`: encode, HTTP on loopback, decode, batcher, answer).
* Under attack (issue 24): 200 concurrent adversarial requests against a tiny-world reward server
  (1 MB prompts, 8,000-character prompts for the old regex, the AVQA prompt, 32 prompts at the
  prompt limit, 2048 x 2048 and 1024 x 1024 frames) while one client sends good requests one after
  another: the good requests' latency (target: median under 1 s), every adversarial answer's status
  (all 4xx), and the server's peak RSS (VmHWM; target: under RSS_BOUND_MB).
* Padded bodies (issue 42): 16 requests at once, each a valid payload whose Content-Length
  declares 250 MB of padding after it, streamed by the client until the server answers or closes;
  a fresh server's peak RSS, the statuses, and the padding each client got to send.

Both servers are real child processes on 127.0.0.1. Rounds alternate the arms so that other load
on the machine hits them alike; the report gives medians (and the per-round values in the JSON).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch
from safetensors.torch import save as save_tensors

from ..media import MediaBatch
from ..serving.client import RemoteReward
from ..serving.process import ServerProcess
from ..serving.wire import CONTENT_TYPE, MAX_PROMPT_CHARS, encode_media
from .common import machine_info

CLIP_RATE = 48_000
TARGET_THROUGHPUT_RATIO = 3.0
TARGET_OVERHEAD_MS = 20.0
TARGET_GOOD_MEDIAN_S = 1.0  # a good request's median latency under attack
RSS_BOUND_MB = 1024  # the attacked server's peak resident memory (at rest: about 250 MB with CPU torch)
ATTACKED_REWARDS = ["color_match", "shape_match", "clean_background", "avqa_exact"]


def _clips(n: int, seed: int) -> MediaBatch:
    """`n` seeded noise clips of one second at 48 kHz."""
    gen = torch.Generator().manual_seed(seed)
    return MediaBatch(audio=0.3 * torch.randn((n, 1, CLIP_RATE), generator=gen), sample_rate=CLIP_RATE)


async def _throughput(
    client: RemoteReward, clients: int, requests_per_client: int, prompts: list[str]
) -> float:
    """Samples per second with `clients` concurrent callers, each sending one clip per request."""
    clip = _clips(1, 1)

    async def caller(i: int) -> None:
        for j in range(requests_per_client):
            await client.score_async(clip, [prompts[(i + j) % len(prompts)]])

    start = time.perf_counter()
    await asyncio.gather(*(caller(i) for i in range(clients)))
    return clients * requests_per_client / (time.perf_counter() - start)


def _overhead(local: Any, served: RemoteReward, repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of one 16-clip batch scored in process and through the server, interleaved, after
    checking that both give the same scores."""
    from rewards.tiny_models import CLAP_CORPUS

    batch, prompts = _clips(16, 2), [CLAP_CORPUS[i % len(CLAP_CORPUS)] for i in range(16)]
    assert torch.allclose(local.score(batch, prompts), served.score(batch, prompts).scores, atol=1e-5)
    in_process, over_http = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        local.score(batch, prompts)
        t1 = time.perf_counter()
        served.score(batch, prompts)
        t2 = time.perf_counter()
        in_process.append(t1 - t0)
        over_http.append(t2 - t1)
    return in_process, over_http


def run_reward_server_bench(
    output: Path,
    rounds: int = 5,
    clients: int = 32,
    requests_per_client: int = 8,
    overhead_repeats: int = 10,
    adversarial_requests: int = 200,
    padded_requests: int = 16,
    padding_mb: int = 250,
) -> dict[str, Any]:
    """Throughput (batched vs batch size 1), client overhead and behaviour under attack; print a
    table, write JSON to `output`."""
    from rewards.clap import ClapReward
    from rewards.tiny_models import CLAP_CORPUS, save_tiny_clap

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(save_tiny_clap(Path(tmp) / "clap"))
        batched = ServerProcess(["clap"], "--checkpoint", checkpoint, "--max-batch", "32")
        single = ServerProcess(["clap"], "--checkpoint", checkpoint, "--max-batch", "1")
        try:
            batched.start()
            single.start()
            fast, slow = RemoteReward(batched.url, "clap"), RemoteReward(single.url, "clap")
            for client in (fast, slow):  # warm-up: connections, first model calls
                client.score(_clips(4, 0), CLAP_CORPUS[:4])

            async def both_arms() -> tuple[float, float]:
                a = await _throughput(fast, clients, requests_per_client, CLAP_CORPUS)
                b = await _throughput(slow, clients, requests_per_client, CLAP_CORPUS)
                return a, b

            rates = [fast._run(both_arms()) for _ in range(rounds)]  # noqa: SLF001 - the client's loop
            mean_batch = fast.info()["stats"]["clap"]["mean_batch"]

            in_process, served = _overhead(ClapReward(checkpoint=checkpoint), fast, overhead_repeats)
            fast.close()
            slow.close()
        finally:
            batched.stop()
            single.stop()

    batched_rate = statistics.median(r[0] for r in rates)
    single_rate = statistics.median(r[1] for r in rates)
    ratio = statistics.median(a / b for a, b in rates)
    local_ms, served_ms = statistics.median(in_process) * 1e3, statistics.median(served) * 1e3
    result = {
        "model": "tiny random-init CLAP (transformers ClapModel; 1 s window at 48 kHz)",
        "throughput": {
            "clients": clients,
            "requests_per_client": requests_per_client,
            "rounds": rounds,
            "batched_samples_per_s": round(batched_rate, 2),
            "batch1_samples_per_s": round(single_rate, 2),
            "ratio": round(ratio, 3),
            "mean_batch_size": mean_batch,
            "target_ratio": TARGET_THROUGHPUT_RATIO,
            "per_round": [[round(a, 2), round(b, 2)] for a, b in rates],
        },
        "overhead": {
            "batch": "16 clips x 1 s x 48 kHz, float32 (3.1 MB)",
            "in_process_ms": round(local_ms, 2),
            "served_ms": round(served_ms, 2),
            "added_ms": round(served_ms - local_ms, 2),
            "ratio": round(served_ms / local_ms, 3),
            "target_added_ms": TARGET_OVERHEAD_MS,
            "in_process_ms_each": [round(t * 1e3, 2) for t in in_process],
            "served_ms_each": [round(t * 1e3, 2) for t in served],
        },
        "adversarial": run_adversarial(adversarial_requests),
        "padded": run_padded(padded_requests, padding_mb),
        "machine": machine_info(),
    }
    print(format_table(result))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {output}")
    return result


def format_table(result: dict[str, Any]) -> str:
    """Plain-text table: throughput of both servers, then the client overhead, against the targets."""
    t, o, a = result["throughput"], result["overhead"], result["adversarial"]
    met = {True: "met", False: "NOT met"}
    return "\n".join(
        [
            f"reward server, {t['clients']} concurrent clients, 1 clip per request "
            f"(median of {t['rounds']} rounds)",
            f"  {'batched (max 32)':<22}{t['batched_samples_per_s']:>10.1f} samples/s  "
            f"mean batch {t['mean_batch_size']}",
            f"  {'batch size 1':<22}{t['batch1_samples_per_s']:>10.1f} samples/s",
            f"  ratio {t['ratio']:.2f}x  "
            f"(target >= {t['target_ratio']:g}x: {met[t['ratio'] >= t['target_ratio']]})",
            f"client overhead, {o['batch']}",
            f"  {'in-process':<22}{o['in_process_ms']:>10.2f} ms",
            f"  {'through the server':<22}{o['served_ms']:>10.2f} ms",
            f"  added {o['added_ms']:.2f} ms, ratio {o['ratio']:.3f}  "
            f"(target <= {o['target_added_ms']:g} ms: {met[o['added_ms'] <= o['target_added_ms']]})",
            *adversarial_lines(a, met),
            *padded_lines(result["padded"], met),
        ]
    )


def padded_lines(p: dict[str, Any], met: dict[bool, str]) -> list[str]:
    """The table's lines for the padded bodies."""
    return [
        f"padded bodies: {p['requests']} at once, each a {p['payload_kb']:.0f} KB payload declaring "
        f"{p['padding_mb']} MB of padding after it; answers {p['statuses']}",
        f"  padding sent before the server answered or closed: median {p['padding_sent_mb']['median']:.1f} "
        f"MB, max {p['padding_sent_mb']['max']:.1f} MB",
        f"  server peak RSS {p['rss_peak_mb']:.0f} MB (at start {p['rss_start_mb']:.0f} MB; bound "
        f"{p['rss_bound_mb']} MB: {met[p['rss_peak_mb'] < p['rss_bound_mb']]})",
    ]


def adversarial_lines(a: dict[str, Any], met: dict[bool, str]) -> list[str]:
    """The table's lines for the server under attack."""
    good, target = a["good_latency_s"], a["target_good_median_s"]
    quiet = _seconds(a["quiet_latency_s"]["median"])
    if good["count"]:
        latency = (
            f"  good request latency: median {good['median']:.3f} s, p90 {good['p90']:.3f} s, "
            f"max {good['max']:.3f} s (quiet: median {quiet}; "
            f"target median < {target:g} s: {met[good['median'] < target]}); answers {a['good_statuses']}"
        )
    else:
        latency = (
            f"  good request latency: no good request finished during the flood (quiet: median {quiet}; "
            f"target median < {target:g} s: {met[False]})"
        )
    lines = [
        f"under attack: {a['requests']} concurrent adversarial requests ({a['flood_s']:.1f} s), "
        f"{good['count']} good requests during it from another client",
        latency,
        f"  server peak RSS {a['rss_peak_mb']:.0f} MB (at start {a['rss_start_mb']:.0f} MB; bound "
        f"{a['rss_bound_mb']} MB: {met[a['rss_peak_mb'] < a['rss_bound_mb']]})",
    ]
    for kind, row in a["kinds"].items():
        lines.append(f"  {kind:<34}{row['statuses']}  (body {row['body_mb']:.2f} MB)")
    return lines


def _seconds(value: float | None) -> str:
    return "none timed" if value is None else f"{value:.3f} s"


# ------------------------------------------------------------------------------------------ under attack
def _adversarial_bodies() -> dict[str, tuple[str, bytes]]:
    """The attacker's requests of issue 24 (and a maximal legal header): kind -> (path, body)."""
    from ..world import tiny_world as world

    gen = torch.Generator().manual_seed(0)
    _, video, amps = world.synthetic_clips(1, gen)
    clip = MediaBatch(
        video=video, audio=world.synthesize_audio(amps), fps=world.FPS, sample_rate=world.SAMPLE_RATE
    )
    clips = MediaBatch(
        video=video.expand(32, -1, -1, -1, -1),
        audio=clip.audio.expand(32, -1, -1),
        fps=clip.fps,
        sample_rate=clip.sample_rate,
    )
    answers = MediaBatch(
        video=video, audio=clip.audio, fps=clip.fps, sample_rate=clip.sample_rate, text=["a"]
    )
    return {
        "1 MB prompt": ("/score/color_match", encode_media(clip, ["red circle " * 95_000], torch.float16)),
        "8,000-character prompt": (
            "/score/color_match",
            encode_media(clip, ["red circle " * 730], torch.float16),
        ),
        "AVQA describe prompt": (
            "/score/avqa_exact",
            encode_media(answers, ["describe | " + "red circle " * 1000], torch.float16),
        ),
        "32 prompts at the limit": (
            "/score/color_match",
            encode_media(clips, [("red circle " * 1490)[:MAX_PROMPT_CHARS]] * 32, torch.float16),
        ),
        "2048 x 2048 frames (48 MB)": ("/score/clean_background", _frames_body(2048)),
        "1024 x 1024 frames (12 MB)": ("/score/shape_match", _frames_body(1024)),
    }


def _frames_body(side: int) -> bytes:
    video = torch.zeros(1, 2, 3, side, side, dtype=torch.float16)
    return save_tensors(
        {"video": video}, metadata={"prompts": '["a red circle"]', "fps": "8", "sample_rate": "8000"}
    )


def _good_body() -> bytes:
    from ..world import tiny_world as world

    prompts, video, amps = world.synthetic_clips(4, torch.Generator().manual_seed(1))
    media = MediaBatch(
        video=video, audio=world.synthesize_audio(amps), fps=world.FPS, sample_rate=world.SAMPLE_RATE
    )
    return encode_media(media, prompts)


def _rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of process `pid` in MB, from /proc (Linux)."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


async def _post(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    """The status of one POST (0: the connection failed before an answer)."""
    try:
        async with session.post(url, data=body, headers={"Content-Type": CONTENT_TYPE}) as answer:
            await answer.read()
            return answer.status
    except aiohttp.ClientError:
        return 0


def _good_client(url: str, stop: threading.Event, out: list[tuple[float, float, int]]) -> None:
    """Good requests one after another until `stop` is set, on this thread's own event loop (a client
    apart from the attacker's): (when it started, seconds, status) each."""

    async def run() -> None:
        body = _good_body()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            while not stop.is_set():
                start = time.perf_counter()
                status = await _post(session, f"{url}/score/shape_match", body)
                out.append((start, time.perf_counter() - start, status))

    asyncio.run(run())


async def _flood(url: str, kinds: list[str], bodies: dict[str, tuple[str, bytes]]) -> list[int]:
    """Every request of `kinds` at once, each on its own connection: their statuses."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        return await asyncio.gather(*(_post(session, url + bodies[k][0], bodies[k][1]) for k in kinds))


def _attack(url: str, requests: int, quiet_s: float = 1.0) -> dict[str, Any]:
    """`requests` adversarial requests at once (the kinds in turn) while another client sends good
    requests; the good ones are timed before (quiet) and during the flood."""
    bodies = _adversarial_bodies()
    kinds = [list(bodies)[i % len(bodies)] for i in range(requests)]
    stop, timed = threading.Event(), []
    good = threading.Thread(target=_good_client, args=(url, stop, timed), daemon=True)
    good.start()
    time.sleep(quiet_s)
    start = time.perf_counter()
    statuses = asyncio.run(_flood(url, kinds, bodies))
    end = time.perf_counter()
    stop.set()
    good.join(timeout=300)
    by_kind: dict[str, dict[str, Any]] = {
        k: {"statuses": {}, "body_mb": round(len(bodies[k][1]) / 2**20, 3)} for k in bodies
    }
    for kind, status in zip(kinds, statuses, strict=True):
        _count(by_kind[kind]["statuses"], status)
    during = [(t, status) for began, t, status in timed if start <= began + t and began <= end]
    good_statuses: dict[str, int] = {}
    for _, status in during:
        _count(good_statuses, status)
    return {
        "kinds": by_kind,
        "flood_s": round(end - start, 3),
        "good_latency_s": _summary([t for t, _ in during]),
        "good_statuses": good_statuses,
        "quiet_latency_s": _summary([t for began, t, _ in timed if began + t < start]),
    }


def _count(counts: dict[str, int], status: int) -> None:
    counts[str(status)] = counts.get(str(status), 0) + 1


def _summary(seconds: list[float]) -> dict[str, Any]:
    """Count, median, p90 and max of `seconds`; the statistics are None when none was timed (a client
    whose every request was still pending)."""
    ordered = sorted(seconds)
    if not ordered:
        return {"count": 0, "median": None, "p90": None, "max": None, "each": []}
    return {
        "count": len(ordered),
        "median": round(statistics.median(ordered), 4),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
        "max": round(ordered[-1], 4),
        "each": [round(t, 4) for t in seconds],
    }


def run_adversarial(requests: int = 200) -> dict[str, Any]:
    """A tiny-world reward server (default settings) under `requests` concurrent adversarial requests."""
    with ServerProcess(ATTACKED_REWARDS) as server:
        assert server.proc is not None
        rss_start, _ = _rss_mb(server.proc.pid)
        result = _attack(server.url, requests)
        _, rss_peak = _rss_mb(server.proc.pid)
        alive = server.proc.poll() is None
    return {
        "requests": requests,
        "rewards": ATTACKED_REWARDS,
        **result,
        "server_alive": alive,
        "rss_start_mb": round(rss_start, 1),
        "rss_peak_mb": round(rss_peak, 1),
        "rss_bound_mb": RSS_BOUND_MB,
        "target_good_median_s": TARGET_GOOD_MEDIAN_S,
    }


# ------------------------------------------------------------------------------------------ padded bodies
def _padded_request(url: str, payload: bytes, padding: int) -> tuple[int, int]:
    """POST `payload` declaring `padding` more bytes, streamed in 1 MB pieces until the server
    answers or closes: (status, 0 when no answer came; padding bytes sent)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    piece, sent = bytes(1 << 20), 0
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        head = (
            f"POST /score/shape_match HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: {CONTENT_TYPE}\r\n"
            f"Content-Length: {len(payload) + padding}\r\n\r\n"
        )
        try:
            sock.sendall(head.encode() + payload)
            sock.setblocking(False)
            while sent < padding:
                try:
                    if sock.recv(1, socket.MSG_PEEK):
                        break  # the server answered
                except BlockingIOError:
                    pass
                try:
                    sent += sock.send(piece[: padding - sent])
                except BlockingIOError:
                    time.sleep(0.001)
            sock.setblocking(True)
            reply = sock.recv(65536)
        except OSError:  # reset or closed while sending: the server stopped reading
            return 0, sent
    status = reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/1.1 ") else b"0"
    return int(status), sent


def run_padded(requests: int = 16, padding_mb: int = 250) -> dict[str, Any]:
    """A fresh tiny-world reward server under `requests` padded bodies at once: their statuses, the
    padding each got to send, and the server's peak RSS."""
    from concurrent.futures import ThreadPoolExecutor

    payload = _good_body()
    with ServerProcess(ATTACKED_REWARDS) as server:
        assert server.proc is not None
        rss_start, _ = _rss_mb(server.proc.pid)
        with ThreadPoolExecutor(requests) as pool:
            done = list(
                pool.map(lambda _: _padded_request(server.url, payload, padding_mb << 20), range(requests))
            )
        _, rss_peak = _rss_mb(server.proc.pid)
        alive = server.proc.poll() is None
    statuses: dict[str, int] = {}
    for status, _ in done:
        _count(statuses, status)
    sent = [padding / 2**20 for _, padding in done]
    return {
        "requests": requests,
        "payload_kb": round(len(payload) / 1024, 1),
        "padding_mb": padding_mb,
        "statuses": statuses,
        "padding_sent_mb": {"median": round(statistics.median(sent), 1), "max": round(max(sent), 1)},
        "server_alive": alive,
        "rss_start_mb": round(rss_start, 1),
        "rss_peak_mb": round(rss_peak, 1),
        "rss_bound_mb": RSS_BOUND_MB,
    }
