"""Was the client the reason two compute-bound teacher replicas scaled below 1.7x on 2 cores?

Until this commit, a request waiting for a replica slot looked again every 2 ms
(`asyncio.sleep(0.002)`); now it sleeps until a request ends (`Wakeup`). This script puts the
old wait back on the same client (a patch of `Wakeup.wait`, here only) and measures both against
the same one-thread servers in interleaved rounds: states per second through 1 and 2 replicas,
and the cores the client process used meanwhile.

    OMP_NUM_THREADS=1 python docs/research/scripts/teacher/client_polling.py [rounds] [out.json]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys

from omni_diffusion_rl.benchmarks.teacher import _throughput
from omni_diffusion_rl.serving import teacher_client
from omni_diffusion_rl.serving.process import ServerProcess

STATES, REQUEST = 512, 16
waking = teacher_client.Wakeup.wait


async def polling(self: teacher_client.Wakeup, timeout_s: float) -> None:  # the old wait
    await asyncio.sleep(0.002)


def through(urls: list[str], wait) -> tuple[float, float]:  # noqa: ANN001
    """States per second and client cores through `urls` (the bench's own measurement) with `wait`."""
    teacher_client.Wakeup.wait = wait
    return _throughput(urls, STATES, REQUEST)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    out = sys.argv[2] if len(sys.argv) > 2 else "client_polling.json"
    figures: dict[str, list[tuple[float, float]]] = {}
    serve = ["--max-batch", "16", "--threads", "1"]
    with ServerProcess(["policy"], *serve, command="serve-teacher") as a, ServerProcess(
        ["policy"], *serve, command="serve-teacher"
    ) as b:
        arms = [
            (f"{name}, {n} replica{'s' if n > 1 else ''}", urls, wait)
            for name, wait in (("polling every 2 ms", polling), ("asleep until a slot frees", waking))
            for n, urls in ((1, [a.url]), (2, [a.url, b.url]))
        ]
        for round_ in range(rounds):
            for label, urls, wait in arms if round_ % 2 == 0 else arms[::-1]:
                figures.setdefault(label, []).append(through(urls, wait))
    report = {}
    print("| client | 1 replica states/s | 2 replicas states/s | scaling | client cores (1 / 2) |")
    print("| --- | --- | --- | --- | --- |")
    for name in ("polling every 2 ms", "asleep until a slot frees"):
        one, two = figures[f"{name}, 1 replica"], figures[f"{name}, 2 replicas"]
        scaling = [d[0] / s[0] for s, d in zip(one, two, strict=True)]
        row = {
            "1 replica states/s": [s for s, _ in one],
            "2 replicas states/s": [s for s, _ in two],
            "scaling": scaling,
            "client cores 1": [c for _, c in one],
            "client cores 2": [c for _, c in two],
        }
        report[name] = row
        med = statistics.median
        print(
            f"| {name} | {med(row['1 replica states/s']):.0f} | {med(row['2 replicas states/s']):.0f} | "
            f"{med(scaling):.2f} [{min(scaling):.2f}-{max(scaling):.2f}] | "
            f"{med(row['client cores 1']):.2f} / {med(row['client cores 2']):.2f} |"
        )
    with open(out, "w") as f:
        json.dump({"rounds": rounds, "states": STATES, "request_samples": REQUEST, **report}, f, indent=1)


if __name__ == "__main__":
    main()
