"""What a run learns from, chosen once from the policy and the algorithm: media (a generator's
samples, experience/rollout.py) or answers (an answering language model's, experience/text_rollout.py).

The kind owns everything that differs between the two, so that the loop (trainer.py), the execution
modes and the planner never ask which one they run:

- its experience maker (which also names the batch type that crosses process boundaries);
- its held-out evaluation and previews (evaluator.py);
- its unit of cost for the planner: a sampling step of a media sample, a token of an answer.

A policy says it answers with `kind = "answers"`; an algorithm says what it trains with
`Algorithm.experience_kind`. Which data set, rewards and eval metrics a run uses are plug-ins
(registry.py) that the kinds do not know about.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ExperimentConfig
from ..experience.guidance import checked_guidance
from ..experience.rollout import ExperienceMaker, score
from ..precision import autocast_factory, resolve_mixed_precision
from ..prompts import ready_to_answer, refuse_question_files
from ..reward import WeightedReward
from ..runtime.sharding import Sharder
from .evaluator import AnswerHeldOut, HeldOut
from .learner import Learner
from .skeleton import algorithm_class

MEDIA, ANSWERS = "media", "answers"
KIND_NAMES = (MEDIA, ANSWERS)


def policy_kind(policy: Any) -> str:
    """What a policy makes: answers when it says so (`kind = "answers"`), media otherwise."""
    return ANSWERS if getattr(policy, "kind", None) == ANSWERS else MEDIA


class ExperienceKind:
    """What differs between learning from media and from answers (see the module docstring)."""

    name: str
    noun: str  # what the policy is, for errors
    held_out_type: type[HeldOut] = HeldOut

    def make_experience(
        self,
        cfg: ExperimentConfig,
        policy: Any,
        reward: WeightedReward,
        prompts: list[str],
        device: torch.device,
        sharder: Sharder | None = None,
    ) -> ExperienceMaker:
        raise NotImplementedError

    def held_out(
        self,
        cfg: ExperimentConfig,
        learner: Learner,
        reward: WeightedReward,
        eval_prompts: list[str],
        output_dir: Path,
        sharded: bool,
    ) -> HeldOut:
        """The run's held-out set, evaluated and previewed with the trained weights."""
        return self.held_out_type(cfg, learner, reward, eval_prompts, output_dir, sharded)

    def cost_length(self, trainer: Any, prompts: list[str], groups: int, steps: int) -> float | None:
        """The planner's length unit when it is not the sampling step (None: it is)."""
        return None

    def cost_rollout(self, trainer: Any, prompts: list[str], groups: int, steps: int) -> Callable[[], Any]:
        """A call that makes and scores `groups` prompt groups with the rollout weights, as the planner
        times it."""
        raise NotImplementedError


class MediaExperience(ExperienceKind):
    """A generator's samples: ODE or SDE rollouts scored by media rewards, evaluated and previewed
    on the held-out prompts; the planner's length unit is one sampling step."""

    name = MEDIA
    noun = "a media generator"

    def make_experience(
        self,
        cfg: ExperimentConfig,
        policy: Any,
        reward: WeightedReward,
        prompts: list[str],
        device: torch.device,
        sharder: Sharder | None = None,
    ) -> ExperienceMaker:
        """Generation with the algorithm's rollout weights in the run's precision, guided as the
        run says; `sharder`: an in-process teacher is sharded with the training processes."""
        refuse_question_files(cfg.data)
        s = cfg.sampling
        algorithm = algorithm_class(cfg.algorithm.name)
        cfg_scale = checked_guidance(policy, s.cfg_scale, cfg.algorithm.name, algorithm.trains_guided)
        return ExperienceMaker(
            policy,
            reward,
            prompts,
            cfg.train.seed,
            cfg.data.group_size,
            s.num_steps,
            s.time_shift,
            s.solver,
            s.rollout_chunks,
            rollout_weights=lambda: algorithm.rollout_weights(policy.transformer),
            load_rollout_state=lambda tensors: algorithm.load_rollout_state(policy.transformer, tensors),
            autocast=autocast_factory(resolve_mixed_precision(cfg.train.mixed_precision), device),
            annotator=algorithm.experience_annotator(cfg, policy, sharder),
            sde=algorithm.sde_sampling(cfg),
            cfg_scale=cfg_scale,
        )

    def cost_rollout(self, trainer: Any, prompts: list[str], groups: int, steps: int) -> Callable[[], Any]:
        """A call that generates, decodes and scores `groups` prompt groups at `steps` sampling steps
        with the rollout weights, and asks the algorithm's annotator (a distillation teacher) for what
        it attaches: the teacher's time counts as rollout time, as on a rollout process."""
        k = trainer.cfg.data.group_size
        noise = torch.randn(
            (groups * k, *trainer.policy.latent_shape), generator=torch.Generator().manual_seed(0)
        )

        def rollout() -> Any:
            out = trainer.experience.generate(prompts[:groups], list(range(groups)), noise, steps)
            score(trainer.policy, trainer.reward, out)
            annotator = trainer.experience.annotator
            if annotator is not None:
                out.extras.update(annotator.submit(out).result())
            return out

        return rollout


class AnswerExperience(ExperienceKind):
    """An answering language model's answers to questions about clips: sampled by the run's answer
    backend, scored by answer rewards, evaluated and previewed by the evaluation registered for the
    model family; the planner's length unit is one answer token."""

    name = ANSWERS
    noun = "an answering language model"
    held_out_type = AnswerHeldOut

    def make_experience(
        self,
        cfg: ExperimentConfig,
        policy: Any,
        reward: WeightedReward,
        prompts: list[str],
        device: torch.device,
        sharder: Sharder | None = None,
    ) -> ExperienceMaker:
        from ..answer_data.style import QuestionStyle
        from ..experience.answer_backends import answer_backend
        from ..experience.text_rollout import TextExperienceMaker

        algorithm = algorithm_class(cfg.algorithm.name)
        checked_guidance(policy, cfg.sampling.cfg_scale, cfg.algorithm.name, algorithm.trains_guided)
        ready_to_answer(cfg.data, cfg.model.family, policy)
        a = cfg.algorithm
        precision = resolve_mixed_precision(cfg.train.mixed_precision)
        return TextExperienceMaker(  # type: ignore[return-value]
            policy,
            reward,
            prompts,
            cfg.train.seed,
            cfg.data.group_size,
            a.max_new_tokens,
            a.temperature,
            a.min_new_tokens,
            rollout_weights=lambda: algorithm.rollout_weights(policy.transformer),
            load_rollout_state=lambda tensors: algorithm.load_rollout_state(policy.transformer, tensors),
            autocast=autocast_factory(precision, device),
            backend=answer_backend(cfg, precision, lambda: algorithm.rollout_state(policy.transformer)),
            questions=cfg.data.questions,
            style=QuestionStyle.of(cfg.data),
        )

    def held_out(
        self,
        cfg: ExperimentConfig,
        learner: Learner,
        reward: WeightedReward,
        eval_prompts: list[str],
        output_dir: Path,
        sharded: bool,
    ) -> HeldOut:
        ready_to_answer(cfg.data, cfg.model.family, learner.policy)
        return super().held_out(cfg, learner, reward, eval_prompts, output_dir, sharded)

    def cost_length(self, trainer: Any, prompts: list[str], groups: int, steps: int) -> float | None:
        """The mean answer length in tokens, as the run's answers come out (natural, or forced by
        algorithm.min_new_tokens): the planner's length unit is the answer token."""
        probe = self.cost_rollout(trainer, prompts, groups, 0)()
        return max(1.0, float(probe.answer_mask.sum(-1).float().mean()))

    def cost_rollout(self, trainer: Any, prompts: list[str], groups: int, steps: int) -> Callable[[], Any]:
        """A call that answers and scores `groups` prompt groups with the rollout weights."""
        from ..experience.text_rollout import answer_media

        def rollout() -> Any:
            answers = trainer.experience.generate(prompts[:groups], list(range(groups)), 0)
            trainer.reward(answer_media(trainer.policy, answers), answers.prompts, check=False)
            return answers

        return rollout


KINDS: dict[str, ExperienceKind] = {MEDIA: MediaExperience(), ANSWERS: AnswerExperience()}


def experience_kind(cfg: ExperimentConfig, policy: Any) -> ExperienceKind:
    """The kind of experience a run learns from, refused unless the algorithm trains what the
    policy makes."""
    made = policy_kind(policy)
    trained = algorithm_class(cfg.algorithm.name).experience_kind
    if trained not in KINDS:
        raise ConfigError(
            f"algorithm '{cfg.algorithm.name}' says it trains experience_kind={trained!r}; an algorithm "
            f"trains one of {', '.join(KIND_NAMES)}"
        )
    if made != trained:
        raise ConfigError(
            f"algorithm.name={cfg.algorithm.name} does not train {KINDS[made].noun} (model.family="
            f"{cfg.model.family}; it trains {KINDS[trained].noun}): gspo trains answering models "
            "(tiny_omni); nft, flow_grpo, raft and distill train generators"
        )
    return KINDS[made]
