"""separate and hybrid: rollout processes generate and score prompt groups continuously; trainer
processes take them from a versioned replay buffer and send the rollout weights back every k steps.

Under `accelerate launch` (or torchrun) ranks 0 .. T-1 train (T = processes - rollout_replicas) and
the others are rollout processes (rollout_worker.py). Every trainer process runs the one training
loop (trainers/trainer.py) with an experience source from here. Rank 0, the trainer leader, holds
the buffer (BufferSource): it takes a step's groups, keeps the first 1/T and sends each other trainer
its contiguous share (ShareSource); the trainers average gradients over their own process group, so
all hold the same weights, and the leader alone syncs the algorithm's rollout weights to rollout.
Messages are safetensors bytes over dedicated gloo groups (transport.py). The staleness bound is
applied when the leader takes a step's groups (stale ones are dropped and counted). hybrid adds
lending: when the buffer runs low and rollout cannot keep up (scheduler.should_lend), the leader
generates a group itself with its current weights, then trains as soon as a step's groups are
there; every lend is counted and timed (the first 200 listed). Checkpoints carry the buffer's
accounting and the stream position, so a resumed run's accounting still balances.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..async_layout import buffer_capacity
from ..buffer import Group, ReplayBuffer
from ..config import ConfigError, ExperimentConfig
from ..distributed import scoped_groups
from ..reward import ScoreResult
from ..rollout import Rollout, cat_results
from ..trainers.sources import ExperienceSource
from ..trainers.trainer import Trainer
from . import scheduler, transport
from .rollout_worker import RolloutWorker

MAX_SWITCH_RECORDS = 200  # lends listed one by one in the summary (all are counted)


def check_layout(cfg: ExperimentConfig, world_size: int) -> int:
    """The number of trainer processes, once the layout is known to work."""
    ex = cfg.execution
    if world_size < 2:
        raise ConfigError(
            f"execution.mode={ex.mode} needs at least 2 processes (accelerate launch --num_processes N, "
            "or torchrun --nproc_per_node N): the first ones train, the others generate"
        )
    if ex.rollout_replicas >= world_size:
        raise ConfigError(
            f"execution.rollout_replicas={ex.rollout_replicas} leaves no trainer among {world_size} "
            f"processes: use at most {world_size - 1}"
        )
    trainers = world_size - ex.rollout_replicas
    if cfg.data.prompts_per_step % trainers:
        raise ConfigError(
            f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the {trainers} trainer "
            f"processes ({world_size} processes - execution.rollout_replicas={ex.rollout_replicas}) so that "
            "each trains whole prompt groups"
        )
    return trainers


def run_separate(
    cfg: ExperimentConfig,
    resume: str | None = None,
    device: torch.device | None = None,
    recheck: Any = None,
) -> dict[str, Any] | None:
    """Run this process's role on `device`; the trainer (rank 0) returns the run summary (and
    tells `recheck`, auto's re-check, about every step)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    trainers = check_layout(cfg, world)
    everyone, trainer_ranks = list(range(world)), list(range(trainers))
    specs: list[tuple[list[int], str | None]] = [(everyone, "gloo"), (everyone, "gloo")]  # data, weights
    if trainers > 1:  # gradients (nccl on GPUs), and the leader's shares
        specs += [(trainer_ranks, None), (trainer_ranks, "gloo")]
    with scoped_groups(specs) as groups:
        data_group, weights_group = groups[:2]
        trainer_group, share_group = groups[2:] if trainers > 1 else (None, None)
        rank = dist.get_rank()
        if rank < trainers:
            source: ExperienceSource = (
                BufferSource(cfg, data_group, weights_group, list(range(trainers, world)), share_group)
                if rank == 0
                else ShareSource(share_group)
            )
            trainer = Trainer(cfg, device=device, group=trainer_group, source=source)
            trainer.recheck = recheck  # the other trainer processes follow the leader's decisions
            return trainer.fit(resume)
        RolloutWorker(cfg, rank - trainers, world - trainers, data_group, weights_group, device).run()
        return None


class ShareSource(ExperienceSource):
    """A trainer process besides the leader: trains the share of each step the leader sends it."""

    def __init__(self, share_group: Any) -> None:
        self.share_group = share_group

    def next_batch(self, step: int) -> tuple[Rollout, ScoreResult]:
        """Blocks until the leader sends the share (a leader that died closes the connection; one
        that failed sends an empty share); hybrid: meanwhile makes the groups the leader asks for."""
        while True:
            data, _ = transport.recv_bytes(0, self.share_group, transport.SHARE_TAG)
            if not data:
                raise RuntimeError(
                    f"the trainer leader (rank 0) failed at step {step + 1}; its error is in its output"
                )
            group_id = transport.lend_request_of(data)
            if group_id is None:
                break
            trainer = self.trainer
            timeout = trainer.cfg.execution.data_timeout_s
            try:
                lent, lent_scored = trainer.experience.make_group(group_id)  # like the leader
                payload = transport.pack_group(lent.to_named(), lent_scored, trainer.step)
            except BaseException:  # an empty lent group: the leader stops with this process
                transport.send_bytes(b"", 0, self.share_group, transport.LENT_TAG, timeout)
                raise
            transport.send_bytes(payload, 0, self.share_group, transport.LENT_TAG, timeout)
        named, scored, _, _ = transport.unpack_group(data)
        self.generated_at = time.perf_counter()
        return self.trainer.experience.batch_type.from_named(named).to(self.trainer.device), scored

    # sharded: the leader's weight syncs gather the rollout adapter from every trainer's shards, so
    # each takes part at the same points (the start, and every sync_every steps)
    def start(self) -> None:
        if self.trainer.sharded:
            self.trainer.algorithm.rollout_state(self.trainer.transformer)

    def after_step(self, ok: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        trainer = self.trainer
        if trainer.sharded and scheduler.should_sync(trainer.step, trainer.cfg.execution.sync_every):
            trainer.algorithm.rollout_state(trainer.transformer)
        return {}


class BufferSource(ExperienceSource):
    """The trainer leader's batches: from the replay buffer that the rollout processes fill (hybrid:
    and the trainers, lent), each other trainer process sent its share."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        data_group: Any,
        weights_group: Any,
        rollout_ranks: list[int],
        share_group: Any = None,
    ) -> None:
        self.cfg = cfg
        self.share_group = share_group
        ex = cfg.execution
        capacity = buffer_capacity(ex.buffer_groups, cfg.data.prompts_per_step)
        self.buffer: ReplayBuffer[tuple[Rollout, ScoreResult]] = ReplayBuffer(capacity, ex.max_staleness)
        self.lend = ex.mode == "hybrid"
        self.loop_start: float | None = None  # the first step's start (start-up and evaluation excluded)
        self.data_group, self.weights_group = data_group, weights_group
        self.rollout_ranks = rollout_ranks
        self.version = 0
        self.ready = threading.Condition()
        self.receiver_error: BaseException | None = None
        self.finished = 0
        self.idle = {"waiting_for_data": 0.0, "weight_sync": 0.0, "switching": 0.0}
        self.depths: list[int] = []
        # the data stream (scheduler.may_make_group): where rollout starts, how far it got, what it skipped
        self.stream_start = self.stream_next = 0
        self.skipped = 0  # stream groups that will never be trained (stale, lost on a resume)
        self.lent_made = self.lent_trained = 0
        self.lend_calls = 0  # this run's: each lends every trainer process for one group
        self.failed_trainers: set[int] = set()  # trainer processes that reported a failed lent group
        self.lending_s = 0.0
        self.switches: list[dict[str, float]] = []
        self.rollout_info: dict[int, dict[str, float]] = {}  # rank -> its last reported timings
        self.lent_call_s: float | None = None
        self.last_train_s: float | None = None
        self.offset_changed = False
        self.group_seconds: list[float] = []  # generation seconds of the groups received since the last step
        self.rollout_idle_at_start: dict[str, float] | None = None
        self.receiver: threading.Thread | None = None
        # a resumed run reports its own share of these (the checkpoint restores the totals)
        self.trained_before = self.lent_made_before = self.lent_trained_before = 0
        self.stopping = False
        self.last_step_end = time.perf_counter()

    # the trainer's step, process group and experience maker
    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        with self.ready:
            return {
                "execution": {
                    "buffer": self.buffer.state_dict(),
                    "stream_next": self.stream_next,
                    "lent_made": self.lent_made,
                    "lent_trained": self.lent_trained,
                }
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream past everything received; what was waiting or in flight is lost
        (counted dropped as `resume`). A colocated checkpoint continues at step * prompts_per_step."""
        saved = state.get("execution")
        p = self.cfg.data.prompts_per_step
        if saved is None:
            self.stream_start = self.step * p
        else:
            self.buffer.load_state_dict(saved["buffer"])
            self.stream_start = int(saved["stream_next"])
            self.lent_made, self.lent_trained = int(saved["lent_made"]), int(saved["lent_trained"])
        self.stream_next = self.stream_start
        self.skipped = self.stream_start - (self.step * p - self.lent_trained)
        self.version = self.step
        self.trained_before = self.buffer.stats.trained
        self.lent_made_before, self.lent_trained_before = self.lent_made, self.lent_trained

    # ------------------------------------------------------------------ receiving groups
    def _receive(self) -> None:
        try:
            while self.finished < len(self.rollout_ranks):
                data, sender = transport.recv_bytes(None, self.data_group, transport.DATA_TAG)
                if not data:
                    self.finished += 1
                    continue
                named, scored, version, info = transport.unpack_group(data)
                rollout = self.trainer.experience.batch_type.from_named(named)
                with self.ready:
                    self.rollout_info[sender] = info
                    self.group_seconds.append(info.get("gen_s", 0.0))
                    while len(self.buffer) >= self.buffer.capacity and not self.stopping:
                        self.ready.wait(timeout=1.0)
                    if self.stopping:  # the run is over: account for what still arrives
                        self.buffer.discard(len(rollout), "run_ended")
                        continue
                    group_id = int(rollout.group_ids[0])
                    self.stream_next = max(self.stream_next, group_id + 1)
                    self.buffer.put(Group(group_id, version, len(rollout), (rollout, scored), time.time()))
                    self.ready.notify_all()
        except BaseException as e:  # surfaced by the training loop
            self.receiver_error = e
            with self.ready:
                self.ready.notify_all()

    def _take(self, start: float) -> list[Group[tuple[Rollout, ScoreResult]]] | None:
        """The step's groups if they are there (under the lock); raises when none can come."""
        timeout = self.cfg.execution.data_timeout_s
        error = self.receiver_error
        if error is not None:
            raise RuntimeError(f"receiving rollout data failed: {error}") from error
        batch = self.buffer.take(self.cfg.data.prompts_per_step, self.version)
        stale_stream = sum(g.group_id < scheduler.LENT_STREAM_START for g in self.buffer.last_stale)
        if stale_stream:  # the stream is trained earlier than the rollout processes think: tell them
            self.skipped += stale_stream
            self.offset_changed = True
        if batch is not None:
            self.ready.notify_all()
            return batch
        if self.finished == len(self.rollout_ranks):
            raise RuntimeError("every rollout process has stopped before the run ended")
        waited = time.perf_counter() - start - self.lending_in_this_wait
        if waited > timeout:
            raise TimeoutError(
                f"no full step of rollout data for {timeout:g} s (execution.data_timeout_s); "
                f"{self.finished} of {len(self.rollout_ranks)} rollout processes have stopped, "
                f"{len(self.buffer)} groups are waiting. Did a rollout process die?"
            )
        return None

    def next_batch(self, step: int) -> tuple[Rollout, ScoreResult]:
        """This process's share of the step's oldest trainable groups from the buffer, waiting for
        them within data_timeout_s (hybrid: generating groups itself while it pays); the other
        trainer processes get theirs."""
        try:
            batch = self._wait_for_step()
        except BaseException as e:
            if self.world_size > 1:  # said first: the launcher may stop this process once the others fail
                print(
                    f"odrl: step {step + 1} failed on the trainer leader: {type(e).__name__}: {e}",
                    file=sys.stderr,
                    flush=True,
                )
                self._release_replicas()
            raise
        self.batch = batch  # all of the step's groups (settled here), in the trainers' rank order
        mine = self._send_shares(batch)
        self.generated_at = time.perf_counter()
        batch_type = self.trainer.experience.batch_type
        rollout = batch_type.cat([g.payload[0].to(self.trainer.device) for g in mine])  # lent ones are here
        return rollout, cat_results([g.payload[1] for g in mine])

    def _release_replicas(self) -> None:
        """The step failed here: an empty share makes each other trainer process fail with it (in
        the collective that follows) instead of waiting for its share."""
        for j in range(1, self.world_size):
            if j in self.failed_trainers:  # it failed first, and is not waiting for a share
                continue
            try:
                transport.send_bytes(
                    b"", j, self.share_group, transport.SHARE_TAG, self.cfg.execution.sync_timeout_s
                )
            except Exception as e:  # the original error is the one to see
                print(f"odrl: could not tell trainer process {j} that the step failed: {e}", file=sys.stderr)

    def _wait_for_step(self) -> list[Group[tuple[Rollout, ScoreResult]]]:
        """All of the step's groups, once the buffer has them (under data_timeout_s)."""
        start = time.perf_counter()
        if self.loop_start is None:
            self.loop_start = start
        self.lending_in_this_wait = 0.0
        if self.rollout_idle_at_start is None:
            self.rollout_idle_at_start = self._rollout_idle()
        while True:
            with self.ready:
                batch = self._take(start)
                lend = batch is None and self.lend and self._should_lend()
            if self.offset_changed:  # without it, a gated rollout process could wait for a step forever
                self.offset_changed = False
                self._send_weights(stop=False, tensors=False)
            if batch is not None:
                break
            if lend:
                self.lending_in_this_wait += self._lend_one_group()  # the receiver keeps filling meanwhile
                continue
            with self.ready:
                if len(self.buffer) < self.cfg.data.prompts_per_step and not self.receiver_error:
                    self.ready.wait(timeout=min(1.0, self.cfg.execution.data_timeout_s))
        self.idle["waiting_for_data"] += time.perf_counter() - start - self.lending_in_this_wait
        self.depths.append(len(self.buffer))
        return batch

    def _send_shares(self, batch: list[Group[tuple[Rollout, ScoreResult]]]) -> list[Group[Any]]:
        """Send trainer j its contiguous share of the step's groups; this process's share back."""
        size = len(batch) // self.world_size
        for j in range(1, self.world_size):  # trainer ranks are global ranks 0 .. T-1
            share = batch[j * size : (j + 1) * size]
            rollout = self.trainer.experience.batch_type.cat([g.payload[0] for g in share])
            scored = cat_results([g.payload[1] for g in share])
            payload = transport.pack_group(rollout.to_named(), scored, self.version)
            transport.send_bytes(payload, j, self.share_group, transport.SHARE_TAG)
        return batch[:size]

    # ------------------------------------------------------------------ hybrid lending
    def _should_lend(self) -> bool:
        """scheduler.should_lend with what was measured: the rollout processes' generation seconds
        per group, the last lent call and the last training step (under the lock)."""
        gen_s = [info["gen_s"] for info in self.rollout_info.values() if info.get("gen_s", 0) > 0]
        rate = scheduler.RolloutRate(sum(1 / s for s in gen_s))
        lent_call = self.lent_call_s if self.lent_call_s is not None else max(gen_s, default=0.0)
        in_flight = len(self.rollout_ranks)  # each rollout process is making a group
        return self.buffer.has_room(self.world_size, in_flight) and scheduler.should_lend(
            len(self.buffer),
            in_flight,
            self.cfg.data.prompts_per_step,
            self.cfg.execution.lend_threshold,
            lent_call,
            rate,
            self.last_train_s,
        )

    def _lend_one_group(self) -> float:
        """Every trainer process generates and scores one group with the current rollout adapter
        (the others on request, meanwhile); all go to the buffer and the lend is logged; returns
        its seconds."""
        start = time.perf_counter()
        depth = len(self.buffer)
        with self.trainer.experience.rollout_weights():  # the switch there and back, timed alone
            pass
        switch_s = time.perf_counter() - start
        first_id = scheduler.LENT_STREAM_START + self.lent_made
        made = self._lend_every_trainer(first_id)
        with self.ready:
            for offset, (rollout, scored) in enumerate(made):
                group = Group(first_id + offset, self.version, len(rollout), (rollout, scored), time.time())
                self.buffer.put(group, overfill=True)
            self.lent_made += len(made)
            self.lend_calls += 1
            self.ready.notify_all()
        seconds = time.perf_counter() - start
        self.lent_call_s = seconds
        self.lending_s += seconds
        self.idle["switching"] += switch_s
        if len(self.switches) < MAX_SWITCH_RECORDS:
            self.switches.append(
                {
                    "step": self.step + 1,
                    "at_s": round(start - (self.loop_start or start), 3),
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
        ex = self.cfg.execution
        asked: list[int] = []
        error: BaseException | None = None
        for j in range(1, self.world_size):  # they wait for their share: they take the request at once
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
                made.append(self.trainer.experience.make_group(first_id))
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
            made.append((self.trainer.experience.batch_type.from_named(named), lent_scored))
        if error is not None:
            raise error
        return made

    # ------------------------------------------------------------------ training and syncing
    def after_step(self, step_ok: torch.Tensor, step_keep: torch.Tensor) -> dict[str, float]:
        """Settle the step's groups in the buffer (trained, or dropped by reason), sync the rollout
        weights every sync_every steps; the buffer, staleness, idle and lending metrics."""
        self.last_train_s = time.perf_counter() - self.generated_at
        with self.ready:  # each group: its trained samples, and those the trainer dropped, by reason
            start = 0
            for group in self.batch:
                rows = slice(start, start + group.size)
                start = rows.stop
                ok, keep = step_ok[rows], step_keep[rows]
                dropped = {"reward_failed": int((~ok).sum()), "group_too_small": int((ok & ~keep).sum())}
                self.buffer.settle(group, self.version, int(keep.sum()), dropped)
                self.lent_trained += group.group_id >= scheduler.LENT_STREAM_START
        self.version += 1
        if scheduler.should_sync(self.version, self.cfg.execution.sync_every):
            start = time.perf_counter()
            self._send_weights(stop=False)
            self.idle["weight_sync"] += time.perf_counter() - start
        lags = self.buffer.stats.staleness
        self.last_step_end = time.perf_counter()
        with self.ready:
            group_seconds, self.group_seconds = self.group_seconds, []
        metrics: dict[str, float] = {}
        self.rollout_group_s = sum(group_seconds) / len(group_seconds) if group_seconds else None
        if self.rollout_group_s is not None:
            metrics["rollout/seconds_per_group"] = self.rollout_group_s
        metrics.update(
            {
                "buffer/depth": float(self.depths[-1]),
                "staleness/max": float(max(lags) if lags else 0),
                "samples/dropped/stale": float(self.buffer.stats.dropped.get("stale", 0)),
                **{f"idle/trainer_{k}_s": v for k, v in self.idle.items()},
                **{f"idle/rollout_{k}_s": v for k, v in self._rollout_idle().items() if k != "generating"},
                **{f"rollout/{k}": v for k, v in self._rollout_totals().items()},
            }
        )
        if self.lend:
            metrics.update({"hybrid/lent_groups": float(self.lent_made), "hybrid/lending_s": self.lending_s})
        return metrics

    def _rollout_totals(self) -> dict[str, float]:
        """The rollout processes' experience-maker totals (teacher seconds and counters), summed over
        processes as last reported (cumulative since they started)."""
        with self.ready:
            infos = [dict(info) for info in self.rollout_info.values()]
        total: dict[str, float] = {}
        for info in infos:
            for key, value in info.items():
                if key.startswith(transport.EXPERIENCE_PREFIX):
                    name = key.removeprefix(transport.EXPERIENCE_PREFIX)
                    total[name] = total.get(name, 0.0) + value
        return total

    def _rollout_idle(self) -> dict[str, float]:
        """The rollout processes' idle (by reason) and generating seconds, summed over processes
        (as last reported; cumulative since they started)."""
        with self.ready:
            infos = [dict(info) for info in self.rollout_info.values()]
        total = {"staleness_gate": 0.0, "buffer_full": 0.0, "weight_sync": 0.0, "generating": 0.0}
        for info in infos:
            for key, value in info.items():
                name = "generating" if key == "generating_s" else key.removeprefix("idle_")
                if name in total:
                    total[name] += value
        return total

    def _send_weights(self, stop: bool, start: bool = False, tensors: bool = True) -> None:
        """The rollout adapter (or, with tensors=False, only the stream position) to every rollout
        process; the start message and stops too."""
        trainer = self.trainer
        message = transport.WeightsMessage(
            version=self.version,
            tensors=trainer.algorithm.rollout_state(trainer.transformer) if tensors and not stop else {},
            stop=stop,
            stream_start=self.stream_start,
            stream_offset=scheduler.stream_offset(self.skipped, self.lent_trained),
        )
        payload = transport.pack_weights(message)
        ex = self.cfg.execution  # the start races the rollout processes' start-up: give it longer
        timeout = max(ex.sync_timeout_s, ex.data_timeout_s) if start else ex.sync_timeout_s
        for dst in self.rollout_ranks:
            try:
                transport.send_bytes(payload, dst, self.weights_group, transport.WEIGHTS_TAG, timeout)
            except TimeoutError as e:
                what = "the start message" if start else "weight sync"
                raise TimeoutError(
                    f"{what} to rollout rank {dst} timed out after {timeout:g} s "
                    "(execution.sync_timeout_s, or data_timeout_s for the start): is it alive?"
                ) from e

    # ------------------------------------------------------------------ the run
    def start(self) -> None:
        """Rollout starts from the trainer's rollout weights and stream position (after a resume)."""
        self.last_step_end = time.perf_counter()
        self._send_weights(stop=False, start=True)
        self.receiver = threading.Thread(target=self._receive, name="rollout-receiver", daemon=True)
        self.receiver.start()

    def abort(self) -> None:
        if not self.stopping:
            self._stop_rollout(quietly=True)  # the original error is the one to see

    def finish(self) -> dict[str, Any]:
        """Stop the rollout processes (before the final evaluation), settle the buffer, report."""
        self._stop_rollout(quietly=False)
        with self.ready:
            self.buffer.drop_waiting("run_ended")
            stats = self.buffer.report()
        return {"execution": self._summary(stats)}

    def _summary(self, buffer_stats: dict[str, Any]) -> dict[str, Any]:
        loop_s = self.last_step_end - (self.loop_start or self.last_step_end)
        trained_prompts = (self.buffer.stats.trained - self.trained_before) / self.cfg.data.group_size
        rollout_s = loop_s * len(self.rollout_ranks)
        at_start = self.rollout_idle_at_start or {}
        rollout_idle = {k: v - at_start.get(k, 0.0) for k, v in self._rollout_idle().items()}
        out = {
            "mode": self.cfg.execution.mode,
            "trainer_replicas": self.world_size,
            "rollout_replicas": len(self.rollout_ranks),
            "seconds_per_trained_prompt": round(loop_s / max(1, trained_prompts), 4),
            "buffer": buffer_stats,
            "idle_s": {k: round(v, 3) for k, v in self.idle.items()},
            "idle_fraction": {
                "trainer": {k: round(v / loop_s, 4) for k, v in self.idle.items()} if loop_s else {},
                "rollout": {k: round(v / rollout_s, 4) for k, v in rollout_idle.items() if k != "generating"}
                if rollout_s
                else {},
            },
            "rollout_generating_fraction": round(rollout_idle["generating"] / rollout_s, 4)
            if rollout_s
            else 0.0,
            "rollout_seconds_since_loop_start": {k: round(v, 3) for k, v in rollout_idle.items()},
            "max_buffer_depth": max(self.depths, default=0),
        }
        if self.lend:
            # this run's lent groups (a resumed run continues the totals)
            lent_groups = self.lent_made - self.lent_made_before
            out["hybrid"] = {
                "lends": self.lend_calls,
                "switches": 2 * self.lend_calls,  # lend, then reclaim
                "lent_groups": lent_groups,
                "lent_groups_trained": self.lent_trained - self.lent_trained_before,
                "lending_s": round(self.lending_s, 3),
                "lends_logged": self.switches,
            }
        return out

    def _stop_rollout(self, quietly: bool) -> None:
        """Tell every rollout process to stop and wait for their last groups."""
        with self.ready:
            self.stopping = True
            self.ready.notify_all()
        try:
            self._send_weights(stop=True)
        except Exception as e:
            if not quietly:
                raise
            print(f"odrl: could not stop the rollout processes cleanly: {e}", file=sys.stderr)
            return
        if self.receiver is None:
            return
        self.receiver.join(timeout=self.cfg.execution.data_timeout_s)
        if self.receiver.is_alive():
            print(
                "odrl: a rollout process did not confirm the stop; the accounting may miss its last groups",
                file=sys.stderr,
            )
