"""The rollout side of separate/hybrid mode: a process that generates and scores prompt groups
with the last rollout weights the trainer sent (the algorithm's), and sends them to the trainer's
buffer.

Rollout process i of R makes the groups at stream positions start + i, start + i + R, ... (start is
0, or where a resumed run continues), each with noise keyed by its position. Under
`execution.on_stale=wait` it holds a group back while it would be trained more than max_staleness
versions after the weights it holds (scheduler.may_make_group). Its idle time is split by reason
(staleness gate, buffer full, weight sync) and reported with every group.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch

from ..config import ExperimentConfig
from ..trainers.trainer import build_experience_maker
from . import scheduler, transport


class RolloutWorker:
    """Generates and scores groups with the last synced rollout weights until told to stop.

    A thread receives weight messages as soon as the trainer sends them (so a sync never waits for
    the group being generated) and the loop applies the newest between groups.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        index: int,
        replicas: int,
        data_group: Any,
        weights_group: Any,
        device: torch.device,
    ) -> None:
        self.cfg, self.index, self.replicas = cfg, index, replicas
        self.data_group, self.weights_group = data_group, weights_group
        self.experience = build_experience_maker(cfg, device)  # policy, reward and data stream, no optimizer
        self.version = 0
        self.stream_offset = 0
        self.inbox: queue.Queue[transport.WeightsMessage] = queue.Queue()
        self.idle = {"staleness_gate": 0.0, "buffer_full": 0.0, "weight_sync": 0.0}
        self.generating_s = 0.0

    def _receive_weights(self) -> None:
        while True:
            data, _ = transport.recv_bytes(0, self.weights_group, transport.WEIGHTS_TAG)
            message = transport.unpack_weights(data)
            self.inbox.put(message)
            if message.stop:
                return

    def _apply(self, message: transport.WeightsMessage) -> bool:
        """Load newer weights (a message without tensors only moves the stream offset); False on
        the stop message."""
        if message.stop:
            return False
        start = time.perf_counter()
        if message.tensors:
            self.experience.load_rollout_state(message.tensors)
            self.version = message.version
            self.experience.policy_step = message.version  # where an SDE window is
        self.stream_offset = message.stream_offset
        self.idle["weight_sync"] += time.perf_counter() - start
        return True

    def _info(self, gen_s: float) -> dict[str, float]:
        """Timings sent with a group: its generation seconds and this process's totals so far (its
        experience maker's too: teacher seconds and counters, as `exp.<name>`)."""
        idle = {f"idle_{k}": v for k, v in self.idle.items()}
        made = {f"{transport.EXPERIENCE_PREFIX}{k}": v for k, v in self.experience.totals().items()}
        return {"gen_s": gen_s, "generating_s": self.generating_s, **idle, **made}

    def run(self) -> None:
        threading.Thread(target=self._receive_weights, name="weights-receiver", daemon=True).start()
        ex, p = self.cfg.execution, self.cfg.data.prompts_per_step
        try:
            timeout = self.cfg.execution.data_timeout_s
            try:  # the start: weights and where the stream continues
                first = self.inbox.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"rollout process {self.index}: no start message from the trainer (rank 0) within "
                    f"{timeout:g} s (execution.data_timeout_s); did it fail to start?"
                ) from None
            if not self._apply(first):
                return
            group_id = first.stream_start + self.index
            while True:
                try:
                    while True:  # apply whatever arrived, newest last
                        if not self._apply(self.inbox.get_nowait()):
                            return
                except queue.Empty:
                    pass
                if ex.on_stale == "wait" and not scheduler.may_make_group(
                    group_id, self.version, ex.max_staleness, p, self.stream_offset
                ):
                    start = time.perf_counter()
                    message = self.inbox.get()  # held back until newer weights (or stop)
                    self.idle["staleness_gate"] += time.perf_counter() - start
                    if not self._apply(message):
                        return
                    continue
                start = time.perf_counter()
                rollout, scored = self.experience.make_group(group_id)
                gen_s = time.perf_counter() - start
                self.generating_s += gen_s
                payload = transport.pack_group(rollout.to_named(), scored, self.version, self._info(gen_s))
                start = time.perf_counter()
                transport.send_bytes(payload, 0, self.data_group, transport.DATA_TAG)
                self.idle["buffer_full"] += time.perf_counter() - start  # the trainer had no room
                group_id += self.replicas
        finally:
            transport.send_bytes(b"", 0, self.data_group, transport.DATA_TAG)  # done marker
            self.experience.reward.close()
            backend = getattr(self.experience, "backend", None)  # an answer sampler (a vLLM engine)
            if backend is not None:
                backend.close()
