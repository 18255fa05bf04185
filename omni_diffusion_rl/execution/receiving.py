"""The trainer leader's receiver: a thread that takes the rollout processes' scored groups into the
replay buffer (waiting while it is full) and keeps what each process last reported of itself."""

from __future__ import annotations

import threading
import time
from typing import Any

from ..buffer import Group, ReplayBuffer
from ..experience.rollout import Rollout
from ..reward import ScoreResult
from . import transport
from .stream import StreamPosition


class GroupReceiver:
    """Receives groups until every rollout process has sent its last; `ready` is the lock (and
    condition) the buffer is shared under."""

    def __init__(
        self,
        buffer: ReplayBuffer[tuple[Rollout, ScoreResult]],
        ready: threading.Condition,
        stream: StreamPosition,
        data_group: Any,
        rollout_ranks: list[int],
        batch_type: Any,
    ) -> None:
        self.buffer, self.ready, self.stream = buffer, ready, stream
        self.data_group, self.rollout_ranks, self.batch_type = data_group, rollout_ranks, batch_type
        self.finished = 0  # rollout processes that sent their last group
        self.error: BaseException | None = None  # surfaced by the training loop
        self.stopping = False  # the run is over: what still arrives is counted, not kept
        self.reports: dict[int, dict[str, float]] = {}  # rank -> its last reported timings
        self.group_seconds: list[float] = []  # generation seconds of the groups since the last step
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._receive, name="rollout-receiver", daemon=True)
        self.thread.start()

    @property
    def all_stopped(self) -> bool:
        return self.finished == len(self.rollout_ranks)

    def _receive(self) -> None:
        try:
            while not self.all_stopped:
                data, sender = transport.recv_bytes(None, self.data_group, transport.DATA_TAG)
                if not data:
                    self.finished += 1
                    continue
                named, scored, version, info = transport.unpack_group(data)
                self._keep(self.batch_type.from_named(named), scored, version, sender, info)
        except BaseException as e:
            self.error = e
            with self.ready:
                self.ready.notify_all()

    def _keep(
        self, rollout: Rollout, scored: ScoreResult, version: int, sender: int, info: dict[str, float]
    ) -> None:
        with self.ready:
            self.reports[sender] = info
            self.group_seconds.append(info.get("gen_s", 0.0))
            while len(self.buffer) >= self.buffer.capacity and not self.stopping:
                self.ready.wait(timeout=1.0)
            if self.stopping:  # the run is over: account for what still arrives
                self.buffer.discard(len(rollout), "run_ended")
                return
            group_id = int(rollout.group_ids[0])
            self.stream.received(group_id)
            self.buffer.put(Group(group_id, version, len(rollout), (rollout, scored), time.time()))
            self.ready.notify_all()

    def stop(self, timeout_s: float) -> bool:
        """Wait for the rollout processes' last groups (after the stop was sent); False: one did not
        confirm within `timeout_s`."""
        if self.thread is None:
            return True
        self.thread.join(timeout=timeout_s)
        return not self.thread.is_alive()

    # ------------------------------------------------------------------ what rollout reported
    def take_group_seconds(self) -> list[float]:
        """The generation seconds of the groups received since the last call."""
        with self.ready:
            seconds, self.group_seconds = self.group_seconds, []
        return seconds

    def generation_seconds(self) -> list[float]:
        """Each rollout process's last reported seconds per group (those that reported one); under
        the lock."""
        return [info["gen_s"] for info in self.reports.values() if info.get("gen_s", 0) > 0]

    def experience_totals(self) -> dict[str, float]:
        """The rollout processes' experience-maker totals (teacher seconds and counters), summed over
        processes as last reported (cumulative since they started)."""
        total: dict[str, float] = {}
        for info in self._reports():
            for key, value in info.items():
                if key.startswith(transport.EXPERIENCE_PREFIX):
                    name = key.removeprefix(transport.EXPERIENCE_PREFIX)
                    total[name] = total.get(name, 0.0) + value
        return total

    def idle(self) -> dict[str, float]:
        """The rollout processes' idle (by reason) and generating seconds, summed over processes
        (as last reported; cumulative since they started)."""
        total = {"staleness_gate": 0.0, "buffer_full": 0.0, "weight_sync": 0.0, "generating": 0.0}
        for info in self._reports():
            for key, value in info.items():
                name = "generating" if key == "generating_s" else key.removeprefix("idle_")
                if name in total:
                    total[name] += value
        return total

    def _reports(self) -> list[dict[str, float]]:
        with self.ready:
            return [dict(info) for info in self.reports.values()]
