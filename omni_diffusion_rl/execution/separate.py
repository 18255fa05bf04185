"""separate: rollout processes generate and score prompt groups continuously; one trainer process
takes them from a versioned replay buffer and sends its rollout adapter back every k steps.

Under `accelerate launch` (or torchrun) rank 0 trains and the last `execution.rollout_replicas`
ranks generate. Messages are safetensors bytes over dedicated gloo groups (transport.py). Rollout
process i makes prompt groups i, i + R, i + 2R, ... of the data stream, each with noise keyed by
its group id, and scores them itself. The trainer's staleness bound is applied when it takes a
step's groups (stale ones are dropped and counted); with `on_stale=wait` a rollout process holding
weights version v also holds back group g while g >= (v + max_staleness + 1) * prompts_per_step,
i.e. while it would be trained more than max_staleness versions later (scheduler.may_make_group).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..buffer import Group, ReplayBuffer, buffer_capacity
from ..config import ConfigError, ExperimentConfig
from ..models import lora
from ..reward import ScoreResult
from ..rollout import Rollout, cat_results, score
from ..trainers.nft import NFTTrainer, step_generator
from . import scheduler, transport


def check_layout(cfg: ExperimentConfig, world_size: int) -> None:
    ex = cfg.execution
    if world_size < 2:
        raise ConfigError(
            "execution.mode=separate needs at least 2 processes (accelerate launch --num_processes N, "
            "or torchrun --nproc_per_node N): rank 0 trains, the others generate"
        )
    if ex.rollout_replicas != world_size - 1:
        raise ConfigError(
            f"execution.rollout_replicas={ex.rollout_replicas}: separate mode runs one trainer process for "
            f"now, so with {world_size} processes it must be {world_size - 1}"
        )


def run_separate(
    cfg: ExperimentConfig, resume: str | None = None, device: torch.device | None = None
) -> dict[str, Any] | None:
    """Run this process's role on `device`; the trainer (rank 0) returns the run summary."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    check_layout(cfg, world)
    rank = dist.get_rank()
    if resume:
        raise ConfigError(
            "--resume is not supported with execution.mode=separate yet; resume a colocated run"
        )
    data_group = dist.new_group(list(range(world)), backend="gloo")
    weights_group = dist.new_group(list(range(world)), backend="gloo")
    if rank == 0:
        trainer = SeparateTrainer(cfg, data_group, weights_group, list(range(1, world)), device)
        return trainer.fit()
    RolloutWorker(cfg, rank - 1, world - 1, data_group, weights_group, device).run()
    return None


class RolloutWorker:
    """Generates and scores groups with the last synced rollout adapter until told to stop.

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
        self.builder = NFTTrainer(cfg, device=device)  # the policy, reward and data stream of one process
        self.version = 0
        self.inbox: queue.Queue[tuple[dict[str, torch.Tensor], int, bool]] = queue.Queue()

    def _receive_weights(self) -> None:
        while True:
            data, _ = transport.recv_bytes(0, self.weights_group, transport.WEIGHTS_TAG)
            message = transport.unpack_weights(data)
            self.inbox.put(message)
            if message[2]:  # stop
                return

    def _apply(self, message: tuple[dict[str, torch.Tensor], int, bool]) -> bool:
        """Load newer weights; False on the stop message."""
        tensors, version, stop = message
        if stop:
            return False
        lora.load_adapter_state_dict(self.builder.transformer, lora.OLD, tensors)
        self.version = version
        return True

    def run(self) -> None:
        threading.Thread(target=self._receive_weights, name="weights-receiver", daemon=True).start()
        ex, p = self.cfg.execution, self.cfg.data.prompts_per_step
        group_id = self.index
        try:
            while True:
                try:
                    while True:  # apply whatever arrived, newest last
                        if not self._apply(self.inbox.get_nowait()):
                            return
                except queue.Empty:
                    pass
                if ex.on_stale == "wait" and not scheduler.may_make_group(
                    group_id, self.version, ex.max_staleness, p
                ):
                    if not self._apply(self.inbox.get()):  # held back until newer weights (or stop)
                        return
                    continue
                rollout, scored = self.make_group(group_id)
                payload = transport.pack_group(rollout, scored, self.version)
                transport.send_bytes(payload, 0, self.data_group, transport.DATA_TAG)
                group_id += self.replicas
        finally:
            transport.send_bytes(b"", 0, self.data_group, transport.DATA_TAG)  # done marker
            self.builder.reward.close()

    def make_group(self, group_id: int) -> tuple[Rollout, ScoreResult]:
        b = self.builder
        gen = step_generator(self.cfg.train.seed, 0, group_id, "rollout")
        noise = torch.randn((self.cfg.data.group_size, *b.policy.latent_shape), generator=gen)
        rollout = b.generate_with_rollout_adapter(
            [b.prompt_at(group_id)], [group_id], noise, self.cfg.sampling.num_steps
        )
        return rollout, score(b.policy, b.reward, rollout)


class SeparateTrainer(NFTTrainer):
    """The colocated trainer's step, fed from the replay buffer instead of its own rollout."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        data_group: Any,
        weights_group: Any,
        rollout_ranks: list[int],
        device: torch.device | None = None,
    ) -> None:
        super().__init__(cfg, device=device)
        ex = cfg.execution
        capacity = buffer_capacity(ex.buffer_groups, cfg.data.prompts_per_step)
        self.buffer: ReplayBuffer[tuple[Rollout, ScoreResult]] = ReplayBuffer(
            capacity, ex.max_staleness, "drop"
        )
        self.loop_start: float | None = None  # the first step's start (start-up and evaluation excluded)
        self.data_group, self.weights_group = data_group, weights_group
        self.rollout_ranks = rollout_ranks
        self.version = 0
        self.ready = threading.Condition()
        self.receiver_error: BaseException | None = None
        self.finished = 0
        self.idle = {"waiting_for_data": 0.0, "weight_sync": 0.0}
        self.depths: list[int] = []

    # ------------------------------------------------------------------ receiving groups
    def _receive(self) -> None:
        try:
            while self.finished < len(self.rollout_ranks):
                data, _ = transport.recv_bytes(None, self.data_group, transport.DATA_TAG)
                if not data:
                    self.finished += 1
                    continue
                rollout, scored, version = transport.unpack_group(data)
                with self.ready:
                    while len(self.buffer) >= self.buffer.capacity and not self.stopping:
                        self.ready.wait(timeout=1.0)
                    if self.stopping:  # the run is over: account for what still arrives
                        self.buffer.discard(len(rollout), "run_ended")
                        continue
                    group = Group(
                        int(rollout.group_ids[0]), version, len(rollout), (rollout, scored), time.time()
                    )
                    self.buffer.put(group)
                    self.ready.notify_all()
        except BaseException as e:  # surfaced by the training loop
            self.receiver_error = e
            with self.ready:
                self.ready.notify_all()

    def rollout(self, step: int) -> tuple[Rollout, ScoreResult]:
        """The step's oldest trainable groups from the buffer (waiting for them, within data_timeout_s)."""
        timeout = self.cfg.execution.data_timeout_s
        start = time.perf_counter()
        if self.loop_start is None:
            self.loop_start = start
        with self.ready:
            while True:
                if self.receiver_error is not None:
                    raise RuntimeError(
                        f"receiving rollout data failed: {self.receiver_error}"
                    ) from self.receiver_error
                batch = self.buffer.take(self.cfg.data.prompts_per_step, self.version)
                if batch is not None:
                    self.ready.notify_all()
                    break
                if self.finished == len(self.rollout_ranks):
                    raise RuntimeError("every rollout process has stopped before the run ended")
                waited = time.perf_counter() - start
                if waited > timeout:
                    raise TimeoutError(
                        f"no full step of rollout data for {timeout:g} s (execution.data_timeout_s); "
                        f"{self.finished} of {len(self.rollout_ranks)} rollout processes have stopped, "
                        f"{len(self.buffer)} groups are waiting. Did a rollout process die?"
                    )
                self.ready.wait(timeout=min(1.0, timeout - waited))
        self.idle["waiting_for_data"] += time.perf_counter() - start
        self.depths.append(len(self.buffer))
        self.batch = batch
        self._t_generated = time.perf_counter()
        return Rollout.cat([g.payload[0] for g in batch]), cat_results([g.payload[1] for g in batch])

    def train_step(self) -> dict[str, float]:
        metrics = super().train_step()
        with self.ready:  # each group: its trained samples, and those learn_from dropped, by reason
            start = 0
            for group in self.batch:
                rows = slice(start, start + group.size)
                start = rows.stop
                ok, keep = self.last_ok[rows], self.last_keep[rows]
                dropped = {"reward_failed": int((~ok).sum()), "group_too_small": int((ok & ~keep).sum())}
                self.buffer.settle(group, self.version, int(keep.sum()), dropped)
        self.version += 1
        if scheduler.should_sync(self.version, self.cfg.execution.sync_every):
            start = time.perf_counter()
            self._send_weights(stop=False)
            self.idle["weight_sync"] += time.perf_counter() - start
        lags = self.buffer.stats.staleness
        self.last_step_end = time.perf_counter()
        metrics.update(
            {
                "buffer/depth": float(self.depths[-1]),
                "staleness/max": float(max(lags) if lags else 0),
                "samples/dropped/stale": float(self.buffer.stats.dropped.get("stale", 0)),
                "idle/trainer_waiting_for_data_s": self.idle["waiting_for_data"],
                "idle/trainer_weight_sync_s": self.idle["weight_sync"],
            }
        )
        return metrics

    def _send_weights(self, stop: bool) -> None:
        tensors = {} if stop else lora.adapter_state_dict(self.transformer, lora.OLD)
        payload = transport.pack_weights(tensors, self.version, stop=stop)
        for dst in self.rollout_ranks:
            try:
                transport.send_bytes(
                    payload, dst, self.weights_group, transport.WEIGHTS_TAG, self.cfg.execution.sync_timeout_s
                )
            except TimeoutError as e:
                raise TimeoutError(
                    f"weight sync to rollout rank {dst} timed out after "
                    f"{self.cfg.execution.sync_timeout_s:g} s (execution.sync_timeout_s): is it alive?"
                ) from e

    def fit(self, resume: str | None = None) -> dict[str, Any]:
        self.stopping = False
        receiver = threading.Thread(target=self._receive, name="rollout-receiver", daemon=True)
        receiver.start()
        self.last_step_end = time.perf_counter()
        try:
            summary = super().fit(resume)
        except BaseException:
            self._stop_rollout(receiver, quietly=True)  # the original error is the one to see
            raise
        self._stop_rollout(receiver, quietly=False)
        with self.ready:
            self.buffer.drop_waiting("run_ended")
            stats = self.buffer.report()
        trained_prompts = self.buffer.stats.trained / self.cfg.data.group_size
        summary["execution"] = {
            "mode": "separate",
            "rollout_replicas": len(self.rollout_ranks),
            "seconds_per_trained_prompt": round(
                (self.last_step_end - (self.loop_start or 0)) / max(1, trained_prompts), 4
            ),
            "buffer": stats,
            "idle_s": {k: round(v, 3) for k, v in self.idle.items()},
        }
        return summary

    def _stop_rollout(self, receiver: threading.Thread, quietly: bool) -> None:
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
        receiver.join(timeout=self.cfg.execution.data_timeout_s)
        if receiver.is_alive():
            print(
                "odrl: a rollout process did not confirm the stop; the accounting may miss its last groups",
                file=sys.stderr,
            )
