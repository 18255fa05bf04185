"""The run's combined reward, built from its RewardConfig.

This sits above both `reward` (the contract and the weighted combination) and `serving.client` (the
reward-server client, which builds on that contract), so neither of them imports the other's side.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from .config import RewardConfig, import_plugins
from .registry import rewards as reward_registry
from .reward import Reward, RewardError, WeightedReward

logger = logging.getLogger(__name__)


def reward_from_config(cfg: RewardConfig) -> WeightedReward:
    """The weighted reward of a RewardConfig: rewards the server at `cfg.url` serves are scored there,
    the rest here (created from the registry with their `cfg.options`)."""
    import_plugins(cfg.plugins)
    served: list[str] = []
    modalities: dict[str, str] = {}
    client_options: dict[str, Any] = {}
    if cfg.url:
        from .serving.client import RemoteReward  # imported only when a server is used

        client_options = {
            "token": os.environ.get(cfg.token_env, ""),  # unset: no token (never another variable's)
            "timeout_s": cfg.timeout_s,
            "retries": cfg.request_retries,
        }
        probe = RemoteReward(cfg.url, "", wanted=list(cfg.weights), **client_options)
        try:
            info = probe.info()
            served = info.get("rewards", [])
            modalities = {k: v for k, v in (info.get("modalities") or {}).items() if isinstance(v, str)}
        finally:
            probe.close()
        if not set(served) & set(cfg.weights):
            raise RewardError(
                f"reward.url={cfg.url} serves {sorted(served)}, but reward.weights uses none of them "
                f"({', '.join(cfg.weights)}): the server would never be asked. Weight a served reward, "
                f"e.g. reward.weights={{{(served or ['NAME'])[0]}: 1.0}}, or leave reward.url out"
            )
    components: dict[str, Reward] = {}
    for name in cfg.weights:
        if name in served:
            if name in cfg.options:
                raise RewardError(
                    f"reward.options.{name}: '{name}' is scored by the server at {cfg.url}; give its "
                    "options to `odrl serve-reward` there instead"
                )
            components[name] = RemoteReward(cfg.url, name, **client_options)
        else:
            components[name] = reward_registry.create(name, **cfg.options.get(name, {}))
    local = sorted(set(cfg.weights) - set(served))
    if cfg.url and local:
        logger.warning("reward.url=%s serves %s; %s will be scored in this process", cfg.url, served, local)
    served_here = {
        name: judged for name, judged in modalities.items() if name in served and name in cfg.weights
    }
    return WeightedReward(
        components,
        cfg.weights,
        retries=cfg.retries,
        max_failed_fraction=cfg.max_failed_fraction,
        modalities=served_here | cfg.modalities,  # the config's keys are weighted rewards (check_consistency)
    )
