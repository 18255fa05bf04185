"""The checks of a config that span several keys or sections (teacher routes, the one-step-off
schedule, the question style, reward names and modalities, the async layout, eval metrics), run once
its sections are built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .algorithm_options import algorithm_card
from .async_layout import buffer_capacity, check_async_layout
from .config_fields import NO_TEACHER, REWARD_MODALITIES, ConfigError, check_registered_name

if TYPE_CHECKING:
    from .config import DataConfig, ExperimentConfig

ROUTE_KEYS = ("parts", "name", "options", "urls")


def check_teacher_routes(routes: dict[str, Any], has_urls: bool) -> None:
    """teacher.routes: each route a mapping of ROUTE_KEYS with a non-empty list of part names; no
    part in two routes (whether the parts cover the student's latent is checked at start)."""
    if routes and has_urls:
        raise ConfigError(
            "teacher.urls and teacher.routes both given: with routes, each route names its own urls"
        )
    owner: dict[str, str] = {}
    for route, spec in routes.items():
        where = f"teacher.routes.{route}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected a mapping such as {{parts: [picture], name: policy}}")
        unknown = sorted(set(spec) - set(ROUTE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown keys {unknown}; a route takes {', '.join(ROUTE_KEYS)}")
        parts = spec.get("parts")
        if not isinstance(parts, list) or not parts or not all(isinstance(p, str) for p in parts):
            raise ConfigError(f"{where}.parts: give a non-empty list of the latent's part names")
        if not isinstance(spec.get("name", "policy"), str):
            raise ConfigError(f"{where}.name: a registered teacher's name, or {NO_TEACHER}")
        if not isinstance(spec.get("options", {}), dict):
            raise ConfigError(f"{where}.options: expected a mapping")
        urls = spec.get("urls", [])
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ConfigError(f"{where}.urls: expected a list of teacher server urls")
        if urls and spec.get("options"):  # a served teacher was built by its server: options would be unread
            raise ConfigError(
                f"{where}: options and urls both given; a route served by teacher servers is built there "
                "(odrl serve-teacher --options), so drop its options here or its urls to build it in process"
            )
        for part in parts:
            if part in owner:
                raise ConfigError(f"teacher.routes: part '{part}' is in routes '{owner[part]}' and '{route}'")
            owner[part] = route


def check_one_step_off(cfg: ExperimentConfig) -> None:
    """teacher.one_step_off hides a teacher's time in the colocated mode, where the overlap runs:
    refused where it would only make the rollouts stale."""
    if cfg.execution.mode != "colocated":
        raise ConfigError(
            f"teacher.one_step_off is a colocated schedule, not one of execution.mode={cfg.execution.mode} "
            "(the async modes make rollouts and their teacher targets apart from training anyway): drop "
            "teacher.one_step_off, or set execution.mode=colocated"
        )
    if not algorithm_card(cfg.algorithm.name).uses_teacher:
        raise ConfigError(
            f"teacher.one_step_off hides a teacher's time, and algorithm.name={cfg.algorithm.name} asks no "
            "teacher: it would only train on stale rollouts; drop it"
        )
    if not cfg.teacher.overlap:
        raise ConfigError(
            "teacher.one_step_off needs teacher.overlap=true: a blocking teacher answers before training "
            "starts, so there is nothing to hide and the rollouts would only be stale"
        )


MAX_SYSTEM_PROMPT_CHARS = 4000


def check_question_style(data: DataConfig) -> None:
    """data.choice_format, option_format and option_separator make a QuestionStyle; the system
    prompt is bounded."""
    from .answer_data.style import QuestionStyle

    try:
        QuestionStyle.of(data)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if data.system_prompt is not None and len(data.system_prompt) > MAX_SYSTEM_PROMPT_CHARS:
        raise ConfigError(
            f"data.system_prompt has {len(data.system_prompt)} characters; at most {MAX_SYSTEM_PROMPT_CHARS}"
        )


def check_consistency(cfg: ExperimentConfig) -> None:
    """Checks that span several keys."""
    if not cfg.train.output_dir.strip():
        raise ConfigError("train.output_dir is empty; give a folder for the run, e.g. runs/my_run")
    algorithm_card(cfg.algorithm.name).check(cfg)  # the algorithm's own checks (its options vs the rest)
    if cfg.train.sharding == "fsdp" and cfg.execution.mode == "auto":
        raise ConfigError(
            "execution.mode=auto measures each mode's costs on whole, unsharded copies of the model, which "
            "is not what a sharded run does: with train.sharding=fsdp choose execution.mode=colocated, "
            "separate or hybrid (`odrl simulate --measure` predicts them)"
        )
    check_teacher_routes(cfg.teacher.routes, bool(cfg.teacher.urls))
    if cfg.teacher.one_step_off:
        check_one_step_off(cfg)
    if not cfg.reward.weights:
        raise ConfigError("reward.weights: at least one reward is needed")
    for name, weight in cfg.reward.weights.items():
        if weight < 0:
            raise ConfigError(f"reward.weights.{name}: {weight} is negative; weights must be >= 0")
    if sum(cfg.reward.weights.values()) <= 0:
        raise ConfigError("reward.weights: the weights sum to 0; give at least one a positive weight")
    for section in ("options", "modalities"):
        for name in getattr(cfg.reward, section):
            if name not in cfg.reward.weights:
                raise ConfigError(
                    f"reward.{section}.{name}: {section} for a reward that reward.weights does not use "
                    f"({', '.join(cfg.reward.weights)})"
                )
    for name, judged in cfg.reward.modalities.items():
        if judged not in REWARD_MODALITIES:
            raise ConfigError(
                f"reward.modalities.{name}: {judged!r} is not a modality; choose one of "
                f"{', '.join(REWARD_MODALITIES)}"
            )
    check_question_style(cfg.data)
    if cfg.execution.mode in ("separate", "hybrid", "auto"):
        ex = cfg.execution
        try:
            check_async_layout(
                ex.sync_every,
                ex.max_staleness,
                buffer_capacity(ex.buffer_groups, cfg.data.prompts_per_step),
                cfg.data.prompts_per_step,
            )
        except ValueError as e:
            raise ConfigError(f"execution: {e}") from e
    check_registered(cfg)
    check_eval_metrics(cfg)
    if cfg.reward.url:
        if not cfg.reward.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.url: '{cfg.reward.url}' must start with http:// or https://")
        from urllib.parse import urlsplit

        parts = urlsplit(cfg.reward.url)
        if parts.path not in ("", "/") or parts.query or parts.fragment or not parts.hostname:
            raise ConfigError(
                f"reward.url: '{cfg.reward.url}' must be scheme://host:port only "
                "(e.g. http://127.0.0.1:8400); the client adds /info and /score/NAME itself"
            )
        return  # which names the server serves is asked at start-up
    from .registry import rewards

    registered = rewards.names()
    for name in cfg.reward.weights:
        if name not in registered:
            raise ConfigError(
                f"reward.weights.{name}: unknown reward '{name}'; registered: {', '.join(registered)} "
                "(register your own with @omni_diffusion_rl.registry.rewards.register or an entry point)"
            )


def check_registered(cfg: ExperimentConfig) -> None:
    """model.family names a registered one (built-ins are entry points, so nothing is imported here;
    reward.plugins files may register more; algorithm.name is checked as its section is built)."""
    from .registry import models

    check_registered_name("model.family", cfg.model.family, models)


def check_eval_metrics(cfg: ExperimentConfig) -> None:
    """eval.metrics names registered scorers, once each, fit for the model family."""
    from .registry import rewards

    registered = rewards.names()
    seen: set[str] = set()
    for name in cfg.eval.metrics:
        if name not in registered:
            raise ConfigError(
                f"eval.metrics: unknown scorer '{name}'; registered: {', '.join(registered)} (any "
                "registered reward can be an eval metric; register your own with "
                "@omni_diffusion_rl.registry.rewards.register or an entry point)"
            )
        if name in seen:
            raise ConfigError(f"eval.metrics: '{name}' is named twice")
        if name in cfg.reward.weights:
            raise ConfigError(
                f"eval.metrics: '{name}' is also in reward.weights; an eval metric must be one the run does "
                "not train on (take it out of one of them)"
            )
        seen.add(name)
    for judge, family, world in (
        ("tiny_world_judge", "tiny_av", "tiny"),
        ("tiny_sync_judge", "tiny_sync", "tiny sync"),
    ):
        if judge in cfg.eval.metrics and cfg.model.family != family:
            raise ConfigError(
                f"eval.metrics: {judge} judges the built-in {world} world's clips only; with "
                f"model.family={cfg.model.family} name other scorers (e.g. eval.metrics=[imagebind]) or none "
                "(eval.metrics=[])"
            )
    for name in cfg.eval.options:
        if name not in cfg.eval.metrics:
            raise ConfigError(
                f"eval.options.{name}: options for a metric that eval.metrics does not name "
                f"({', '.join(cfg.eval.metrics) or 'none'})"
            )
