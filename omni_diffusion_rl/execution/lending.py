"""hybrid's lending: when the buffer runs low and rollout cannot keep up (scheduler.should_lend),
every trainer process generates and scores one prompt group with the current rollout weights, then
goes back to training. Every lend is counted and timed (the first MAX_SWITCH_RECORDS listed)."""

from __future__ import annotations

import threading
import time
from typing import Any

from ..buffer import Group, ReplayBuffer
from ..config import ExperimentConfig
from ..experience.rollout import Rollout
from ..reward import ScoreResult
from ..trainers.sources import SourceContext
from . import scheduler, transport
from .stream import StreamPosition

MAX_SWITCH_RECORDS = 200  # lends listed one by one in the summary (all are counted)


class Lender:
    """The trainer leader's lending: when to lend, the lend itself (asking the other trainer
    processes for one group each), and its records."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        context: SourceContext,
        share_group: Any,
        buffer: ReplayBuffer[tuple[Rollout, ScoreResult]],
        ready: threading.Condition,
        stream: StreamPosition,
    ) -> None:
        self.cfg, self.context, self.share_group = cfg, context, share_group
        self.buffer, self.ready, self.stream = buffer, ready, stream
        self.calls = 0  # this run's: each lends every trainer process for one group
        self.failed_trainers: set[int] = set()  # trainer processes that reported a failed lent group
        self.lending_s = 0.0
        self.switch_s = 0.0  # of which switching to the rollout weights and back
        self.records: list[dict[str, float]] = []
        self.last_call_s: float | None = None
        self.last_train_s: float | None = None  # the last training step's seconds (told by the source)
        self.made_before = self.trained_before = 0  # a resumed run reports its own share

    def should_lend(self, rollout_gen_s: list[float], in_flight: int) -> bool:
        """scheduler.should_lend with what was measured: the rollout processes' generation seconds
        per group, the last lent call and the last training step (under the lock)."""
        rate = scheduler.RolloutRate(sum(1 / s for s in rollout_gen_s))
        lent_call = self.last_call_s if self.last_call_s is not None else max(rollout_gen_s, default=0.0)
        return self.buffer.has_room(self.context.world_size, in_flight) and scheduler.should_lend(
            len(self.buffer),
            in_flight,
            self.cfg.data.prompts_per_step,
            self.cfg.execution.lend_threshold,
            lent_call,
            rate,
            self.last_train_s,
        )

    def lend_one_group(self, version: int, loop_start: float | None) -> float:
        """Every trainer process generates and scores one group with the current rollout weights
        (the others on request, meanwhile); all go to the buffer and the lend is logged; returns
        its seconds."""
        start = time.perf_counter()
        depth = len(self.buffer)
        with self.context.experience.rollout_weights():  # the switch there and back, timed alone
            pass
        switch_s = time.perf_counter() - start
        first_id = scheduler.LENT_STREAM_START + self.stream.lent_made
        made = self._lend_every_trainer(first_id)
        with self.ready:
            for offset, (rollout, scored) in enumerate(made):
                group = Group(first_id + offset, version, len(rollout), (rollout, scored), time.time())
                self.buffer.put(group, overfill=True)
            self.stream.lent_made += len(made)
            self.calls += 1
            self.ready.notify_all()
        seconds = time.perf_counter() - start
        self.last_call_s = seconds
        self.lending_s += seconds
        self.switch_s += switch_s
        if len(self.records) < MAX_SWITCH_RECORDS:
            self.records.append(
                {
                    "step": self.context.step + 1,
                    "at_s": round(start - (loop_start or start), 3),
                    "buffer_groups": depth,
                    "lent_s": round(seconds, 4),
                    "switch_s": round(switch_s, 6),
                }
            )
        return seconds

    def _lend_every_trainer(self, first_id: int) -> list[tuple[Rollout, ScoreResult]]:
        """Groups first_id, first_id + 1, ...: this process's, and one from each other trainer
        process (asked in place of its next share). Every answer is collected before a failure here
        or there is raised, so no trainer is left sending a group nobody takes."""
        ex, experience = self.cfg.execution, self.context.experience
        asked: list[int] = []
        error: BaseException | None = None
        for j in range(1, self.context.world_size):  # they wait for their share: they take it at once
            try:
                request = transport.pack_lend_request(first_id + j)
                transport.send_bytes(request, j, self.share_group, transport.SHARE_TAG, ex.sync_timeout_s)
            except BaseException as e:
                error = e
                break
            asked.append(j)
        made: list[tuple[Rollout, ScoreResult]] = []
        if error is None:
            try:
                made.append(experience.make_group(first_id))
            except BaseException as e:
                error = e
        for j in asked:
            try:
                data, _ = transport.recv_bytes(j, self.share_group, transport.LENT_TAG, ex.data_timeout_s)
            except BaseException as e:
                self.failed_trainers.add(j)
                error = error or e
                continue
            if not data:
                self.failed_trainers.add(j)
                error = error or RuntimeError(
                    f"trainer process {j} failed making lent group {first_id + j}; its error is in its output"
                )
                continue
            named, lent_scored, _, _ = transport.unpack_group(data)
            made.append((experience.batch_type.from_named(named), lent_scored))
        if error is not None:
            raise error
        return made

    def summary(self) -> dict[str, Any]:
        """This run's lends (a resumed run continues the totals)."""
        return {
            "lends": self.calls,
            "switches": 2 * self.calls,  # lend, then reclaim
            "lent_groups": self.stream.lent_made - self.made_before,
            "lent_groups_trained": self.stream.lent_trained - self.trained_before,
            "lending_s": round(self.lending_s, 3),
            "lends_logged": self.records,
        }
