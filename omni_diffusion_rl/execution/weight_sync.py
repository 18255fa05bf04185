"""The trainer leader's weight syncs to the rollout processes: the rollout weights (or only the
stream position), the start message and the stop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..config import ExperimentConfig
from . import transport
from .stream import StreamPosition


class WeightSender:
    """Sends a `WeightsMessage` to every rollout process over the weights group."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        weights_group: Any,
        rollout_ranks: list[int],
        rollout_state: Callable[[], dict[str, torch.Tensor]],
    ) -> None:
        self.cfg, self.weights_group, self.rollout_ranks = cfg, weights_group, rollout_ranks
        self.rollout_state = rollout_state  # sharded: a collective every trainer process joins

    def send(
        self, version: int, stream: StreamPosition, stop: bool, start: bool = False, tensors: bool = True
    ) -> None:
        """The rollout weights (with tensors=False, only the stream position) at `version` to every
        rollout process; the start message (`start`) and the stop (`stop`) too."""
        message = transport.WeightsMessage(
            version=version,
            tensors=self.rollout_state() if tensors and not stop else {},
            stop=stop,
            stream_start=stream.start,
            stream_offset=stream.offset(),
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
