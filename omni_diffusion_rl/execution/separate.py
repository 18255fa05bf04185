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
from ..experience.rollout import Rollout, cat_results
from ..reward import ScoreResult
from ..runtime.distributed import scoped_groups
from ..trainers.sources import ExperienceSource, SourceContext
from ..trainers.trainer import Trainer
from . import scheduler, transport
from .leader_accounts import LeaderAccounts
from .lending import Lender
from .receiving import GroupReceiver
from .rollout_worker import RolloutWorker
from .stream import StreamPosition
from .weight_sync import WeightSender


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
        self.context.experience.policy_step = step  # a lent group's SDE window: these weights'
        while True:
            data, _ = transport.recv_bytes(0, self.share_group, transport.SHARE_TAG)
            if not data:
                raise RuntimeError(
                    f"the trainer leader (rank 0) failed at step {step + 1}; its error is in its output"
                )
            group_id = transport.lend_request_of(data)
            if group_id is None:
                break
            context = self.context
            timeout = context.cfg.execution.data_timeout_s
            try:
                lent, lent_scored = context.experience.make_group(group_id)  # like the leader
                payload = transport.pack_group(lent.to_named(), lent_scored, context.step)
            except BaseException:  # an empty lent group: the leader stops with this process
                transport.send_bytes(b"", 0, self.share_group, transport.LENT_TAG, timeout)
                raise
            transport.send_bytes(payload, 0, self.share_group, transport.LENT_TAG, timeout)
        named, scored, _, _ = transport.unpack_group(data)
        self.generated_at = time.perf_counter()
        return self.context.experience.batch_type.from_named(named).to(self.context.device), scored

    # sharded: the leader's weight syncs gather the rollout adapter from every trainer's shards, so
    # each takes part at the same points (the start, and every sync_every steps)
    def start(self) -> None:
        if self.context.sharded:
            self.context.rollout_state()

    def after_step(self, ok: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        context = self.context
        if context.sharded and scheduler.should_sync(context.step, context.cfg.execution.sync_every):
            context.rollout_state()
        return {}


class BufferSource(ExperienceSource):
    """The trainer leader's batches: from the replay buffer that the rollout processes fill (hybrid:
    and the trainers, lent), each other trainer process sent its share. Its jobs are parts of their
    own: receiving (receiving.py), lending (lending.py), weight syncs (weight_sync.py), accounting
    (leader_accounts.py) and the stream's counters (stream.py); here the buffer is taken from and
    each step's groups are shared out."""

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
        self.ready = threading.Condition()  # the buffer's lock, shared with the receiver and the lender
        self.stream = StreamPosition()
        self.lend = ex.mode == "hybrid"
        self.data_group, self.weights_group = data_group, weights_group
        self.rollout_ranks = rollout_ranks
        self.version = 0

    def attach(self, context: SourceContext) -> None:
        super().attach(context)
        self.receiver = GroupReceiver(
            self.buffer,
            self.ready,
            self.stream,
            self.data_group,
            self.rollout_ranks,
            context.experience.batch_type,
        )
        self.lender = Lender(self.cfg, context, self.share_group, self.buffer, self.ready, self.stream)
        self.weights = WeightSender(self.cfg, self.weights_group, self.rollout_ranks, context.rollout_state)
        self.accounts = LeaderAccounts(
            self.cfg, self.buffer, self.ready, self.stream, self.receiver, self.lender
        )

    # the trainer's step and processes
    @property
    def step(self) -> int:
        return self.context.step

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def rollout_group_s(self) -> float | None:  # type: ignore[override]
        return self.accounts.rollout_group_s

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        with self.ready:
            return {
                "execution": {
                    "buffer": self.buffer.state_dict(),
                    "stream_next": self.stream.next,
                    "lent_made": self.stream.lent_made,
                    "lent_trained": self.stream.lent_trained,
                }
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream past everything received; what was waiting or in flight is lost
        (counted dropped as `resume`). A colocated checkpoint continues at step * prompts_per_step."""
        saved = state.get("execution")
        if saved is not None:
            self.buffer.load_state_dict(saved["buffer"])
        self.stream.resume(self.step, self.cfg.data.prompts_per_step, saved)
        self.version = self.step
        self.accounts.trained_before = self.buffer.stats.trained
        self.lender.made_before, self.lender.trained_before = self.stream.lent_made, self.stream.lent_trained

    # ------------------------------------------------------------------ taking a step's groups
    def _take(self, start: float) -> list[Group[tuple[Rollout, ScoreResult]]] | None:
        """The step's groups if they are there (under the lock); raises when none can come."""
        timeout = self.cfg.execution.data_timeout_s
        error = self.receiver.error
        if error is not None:
            raise RuntimeError(f"receiving rollout data failed: {error}") from error
        batch = self.buffer.take(self.cfg.data.prompts_per_step, self.version)
        stale_stream = sum(g.group_id < scheduler.LENT_STREAM_START for g in self.buffer.last_stale)
        if stale_stream:  # the stream is trained earlier than the rollout processes think: tell them
            self.stream.skipped += stale_stream
            self.stream.offset_changed = True
        if batch is not None:
            self.ready.notify_all()
            return batch
        if self.receiver.all_stopped:
            raise RuntimeError("every rollout process has stopped before the run ended")
        waited = time.perf_counter() - start - self.lending_in_this_wait
        if waited > timeout:
            raise TimeoutError(
                f"no full step of rollout data for {timeout:g} s (execution.data_timeout_s); "
                f"{self.receiver.finished} of {len(self.rollout_ranks)} rollout processes have stopped, "
                f"{len(self.buffer)} groups are waiting. Did a rollout process die?"
            )
        return None

    def next_batch(self, step: int) -> tuple[Rollout, ScoreResult]:
        """This process's share of the step's oldest trainable groups from the buffer, waiting for
        them within data_timeout_s (hybrid: generating groups itself while it pays); the other
        trainer processes get theirs."""
        self.context.experience.policy_step = step  # a lent group's SDE window: these weights'
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
        batch_type = self.context.experience.batch_type
        rollout = batch_type.cat([g.payload[0].to(self.context.device) for g in mine])  # lent ones are here
        return rollout, cat_results([g.payload[1] for g in mine])

    def _release_replicas(self) -> None:
        """The step failed here: an empty share makes each other trainer process fail with it (in
        the collective that follows) instead of waiting for its share."""
        for j in range(1, self.world_size):
            if j in self.lender.failed_trainers:  # it failed first, and is not waiting for a share
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
        self.accounts.waiting_started(start)
        self.lending_in_this_wait = 0.0
        while True:
            with self.ready:
                batch = self._take(start)
                in_flight = len(self.rollout_ranks)  # each rollout process is making a group
                lend = (
                    batch is None
                    and self.lend
                    and self.lender.should_lend(self.receiver.generation_seconds(), in_flight)
                )
            if self.stream.offset_changed:  # without it, a gated rollout process could wait forever
                self.stream.offset_changed = False
                self.weights.send(self.version, self.stream, stop=False, tensors=False)
            if batch is not None:
                break
            if lend:  # the receiver keeps filling meanwhile
                self.lending_in_this_wait += self.lender.lend_one_group(
                    self.version, self.accounts.loop_start
                )
                continue
            with self.ready:
                if len(self.buffer) < self.cfg.data.prompts_per_step and not self.receiver.error:
                    self.ready.wait(timeout=min(1.0, self.cfg.execution.data_timeout_s))
        self.accounts.waiting_s += time.perf_counter() - start - self.lending_in_this_wait
        self.accounts.depths.append(len(self.buffer))
        return batch

    def _send_shares(self, batch: list[Group[tuple[Rollout, ScoreResult]]]) -> list[Group[Any]]:
        """Send trainer j its contiguous share of the step's groups; this process's share back."""
        size = len(batch) // self.world_size
        for j in range(1, self.world_size):  # trainer ranks are global ranks 0 .. T-1
            share = batch[j * size : (j + 1) * size]
            rollout = self.context.experience.batch_type.cat([g.payload[0] for g in share])
            scored = cat_results([g.payload[1] for g in share])
            payload = transport.pack_group(rollout.to_named(), scored, self.version)
            transport.send_bytes(payload, j, self.share_group, transport.SHARE_TAG)
        return batch[:size]

    # ------------------------------------------------------------------ training and syncing
    def after_step(self, step_ok: torch.Tensor, step_keep: torch.Tensor) -> dict[str, float]:
        """Settle the step's groups in the buffer (trained, or dropped by reason), sync the rollout
        weights every sync_every steps; the buffer, staleness, idle and lending metrics."""
        self.lender.last_train_s = time.perf_counter() - self.generated_at
        self.accounts.settle(self.batch, self.version, step_ok, step_keep)
        self.version += 1
        if scheduler.should_sync(self.version, self.cfg.execution.sync_every):
            start = time.perf_counter()
            self.weights.send(self.version, self.stream, stop=False)
            self.accounts.sync_s += time.perf_counter() - start
        return self.accounts.step_metrics()

    # ------------------------------------------------------------------ the run
    def start(self) -> None:
        """Rollout starts from the trainer's rollout weights and stream position (after a resume)."""
        self.accounts.last_step_end = time.perf_counter()
        self.weights.send(self.version, self.stream, stop=False, start=True)
        self.receiver.start()

    def abort(self) -> None:
        receiver = getattr(self, "receiver", None)  # None: never attached, nothing was started
        if receiver is not None and not receiver.stopping:
            self._stop_rollout(quietly=True)  # the original error is the one to see

    def finish(self) -> dict[str, Any]:
        """Stop the rollout processes (before the final evaluation), settle the buffer, report."""
        self._stop_rollout(quietly=False)
        with self.ready:
            self.buffer.drop_waiting("run_ended")
            stats = self.buffer.report()
        return {"execution": self.accounts.summary(stats, self.world_size)}

    def _stop_rollout(self, quietly: bool) -> None:
        """Tell every rollout process to stop and wait for their last groups."""
        with self.ready:
            self.receiver.stopping = True
            self.ready.notify_all()
        try:
            self.weights.send(self.version, self.stream, stop=True)
        except Exception as e:
            if not quietly:
                raise
            print(f"odrl: could not stop the rollout processes cleanly: {e}", file=sys.stderr)
            return
        if not self.receiver.stop(self.cfg.execution.data_timeout_s):
            print(
                "odrl: a rollout process did not confirm the stop; the accounting may miss its last groups",
                file=sys.stderr,
            )
