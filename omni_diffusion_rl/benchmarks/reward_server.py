"""Benchmark: a reward server's batching and its client overhead, on a tiny random-init CLAP model.

* Throughput: 32 concurrent clients each send one 1 s 48 kHz clip per request, to a server that
  batches (max batch 32) and to the same server with max batch 1; samples scored per second.
* Overhead: one batch of 16 one-second 48 kHz clips scored in-process (`ClapReward.score`) and
  through the server (`RemoteReward.score`: encode, HTTP on loopback, decode, batcher, answer).

Both servers are real child processes on 127.0.0.1. Rounds alternate the arms so that other load
on the machine hits them alike; the report gives medians (and the per-round values in the JSON).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ..media import MediaBatch
from ..serving.client import RemoteReward
from ..serving.process import ServerProcess
from .common import machine_info

CLIP_RATE = 48_000
TARGET_THROUGHPUT_RATIO = 3.0
TARGET_OVERHEAD_MS = 20.0


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


def run_reward_server_bench(
    output: Path, rounds: int = 5, clients: int = 32, requests_per_client: int = 8, overhead_repeats: int = 10
) -> dict[str, Any]:
    """Throughput (batched vs batch size 1) and client overhead; print a table, write JSON to `output`."""
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

            local = ClapReward(checkpoint=checkpoint)
            batch, prompts = _clips(16, 2), [CLAP_CORPUS[i % len(CLAP_CORPUS)] for i in range(16)]
            assert torch.allclose(local.score(batch, prompts), fast.score(batch, prompts).scores, atol=1e-5)
            in_process, served = [], []
            for _ in range(overhead_repeats):
                t0 = time.perf_counter()
                local.score(batch, prompts)
                t1 = time.perf_counter()
                fast.score(batch, prompts)
                t2 = time.perf_counter()
                in_process.append(t1 - t0)
                served.append(t2 - t1)
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
        "machine": machine_info(),
    }
    print(format_table(result))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {output}")
    return result


def format_table(result: dict[str, Any]) -> str:
    """Plain-text table: throughput of both servers, then the client overhead, against the targets."""
    t, o = result["throughput"], result["overhead"]
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
        ]
    )
