"""Scored answers of an omni language model: the autoregressive side's experience, made and carried
like the diffusion side's (`rollout.py`): the same prompt stream, seeds keyed by (seed, step, prompt
group), background scoring, the named-batch format between processes and the replay buffer.

A prompt group is one question about one clip, answered `group_size` times: the clip is rendered
from the group's key (tiny AVQA) or decoded from its files (a question file, answer_data/), each
answer sampled from its own key, and the behaviour log-probs of the
sampled tokens are kept with the answers (GSPO's ratio is taken against them, so staleness in the
async modes is handled by the ratio).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..answer_data.clip_files import ClipFormat
from ..answer_data.questions import (
    DEFAULT_QUESTIONS,
    AskedQuestion,
    FileQuestion,
    is_file_key,
    question_set,
    question_text,
)
from ..answer_data.style import PLAIN, QuestionStyle
from ..config import ConfigError
from ..media import MediaBatch
from ..named_batch import BatchSchema, NamedBatch
from ..reward import ScoreResult, WeightedReward
from .answer_backends import AnswerBackend, HfAnswers
from .rollout import PendingExtras, step_generator, stream_prompt
from .text_sampling import selected_prompts


@dataclass
class TextRollout:
    prompts: list[str]  # data-stream prompts ("<kind> | <scene>"), one per sample
    group_ids: torch.Tensor  # [N]
    video: torch.Tensor  # [N, F, 3, H, W] the clip each answer is about
    audio: torch.Tensor  # [N, 1, S]
    questions: torch.Tensor  # [N, Q] question token ids, right-padded
    question_mask: torch.Tensor  # [N, Q] bool
    answers: torch.Tensor  # [N, L] answer token ids (pad after the end)
    answer_mask: torch.Tensor  # [N, L] bool: the answer's tokens, its end token included
    behaviour_logp: torch.Tensor  # [N, L] the sampler's log-probs of its tokens
    truncated: torch.Tensor  # [N] bool: cut by the token limit
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    pending: PendingExtras | None = field(default=None, repr=False, compare=False)

    PER_SAMPLE = (
        "group_ids",
        "video",
        "audio",
        "questions",
        "question_mask",
        "answers",
        "answer_mask",
        "behaviour_logp",
        "truncated",
    )
    SCHEMA = BatchSchema(per_sample=PER_SAMPLE, prefixes=("extra.",), texts=("prompts",), shared=())

    def __len__(self) -> int:
        return len(self.prompts)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in self.PER_SAMPLE}

    def select(self, index: torch.Tensor) -> TextRollout:
        picked = {k: v[index.to(v.device)] for k, v in self._tensors().items()}
        extras = {k: v[index.to(v.device)] for k, v in self.extras.items()}
        return TextRollout([self.prompts[i] for i in index.tolist()], **picked, extras=extras)

    def settle(self) -> TextRollout:
        return self

    def to(self, device: torch.device) -> TextRollout:
        moved = {k: v.to(device) for k, v in self._tensors().items()}
        return TextRollout(self.prompts, **moved, extras={k: v.to(device) for k, v in self.extras.items()})

    def question_ids(self) -> list[list[int]]:
        """Each sample's question tokens as a list (what the model's prompt builder takes)."""
        return [row[m].tolist() for row, m in zip(self.questions, self.question_mask, strict=True)]

    def to_named(self) -> NamedBatch:
        per_sample = {k: v.detach().cpu().contiguous() for k, v in self._tensors().items()}
        per_sample |= {f"extra.{k}": v.detach().cpu().contiguous() for k, v in self.extras.items()}
        return NamedBatch(per_sample, {"prompts": list(self.prompts)}, {})

    @classmethod
    def from_named(cls, batch: NamedBatch) -> TextRollout:
        cls.SCHEMA.check(batch, "an answer rollout")
        t = batch.per_sample
        extras = {k.removeprefix("extra."): v for k, v in t.items() if k.startswith("extra.")}
        return cls(batch.texts["prompts"], **{k: t[k] for k in cls.PER_SAMPLE}, extras=extras)

    @staticmethod
    def cat(parts: list[TextRollout]) -> TextRollout:
        def padded(key: str, value: float | bool) -> torch.Tensor:
            width = max(getattr(p, key).shape[1] for p in parts)
            return torch.cat(
                [
                    torch.nn.functional.pad(
                        getattr(p, key), (0, width - getattr(p, key).shape[1]), value=value
                    )
                    for p in parts
                ]
            )

        return TextRollout(
            prompts=[x for p in parts for x in p.prompts],
            group_ids=torch.cat([p.group_ids for p in parts]),
            video=torch.cat([p.video for p in parts]),
            audio=torch.cat([p.audio for p in parts]),
            questions=padded("questions", 0),
            question_mask=padded("question_mask", False),
            answers=padded("answers", 0),
            answer_mask=padded("answer_mask", False),
            behaviour_logp=padded("behaviour_logp", 0.0),
            truncated=torch.cat([p.truncated for p in parts]),
            extras={k: torch.cat([p.extras[k] for p in parts]) for k in parts[0].extras},
        )


def ask(
    prompt: str,
    gen: torch.Generator,
    clip: ClipFormat,
    questions: str = DEFAULT_QUESTIONS,
    style: QuestionStyle = PLAIN,
) -> AskedQuestion:
    """The question a data-stream prompt names, with its clip: a question file's key is decoded from
    its files at `clip` (its options rendered in `style`); any other prompt is asked by the
    registered question set `questions` (tiny AVQA renders a fresh clip from `gen`)."""
    if is_file_key(prompt):
        return FileQuestion.from_key(prompt).asked(clip, style)
    return question_set(questions).ask(prompt, gen)


def answer_texts(policy: Any, rollout: TextRollout) -> list[str]:
    """The decoded answers (their end token and padding dropped)."""
    return [
        policy.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(rollout.answers, rollout.answer_mask, strict=True)
    ]


def answer_media(policy: Any, rollout: TextRollout) -> MediaBatch:
    """What a reward scores: the clip, and the answer as the batch's text."""
    texts = answer_texts(policy, rollout)
    clip = policy.model.clip_format
    video = rollout.video.float() / 255 if rollout.video.dtype == torch.uint8 else rollout.video
    rates = {"fps": clip.fps, "sample_rate": clip.sample_rate}
    return MediaBatch(video=video, audio=rollout.audio, text=texts, **rates)


class TextExperienceMaker:
    """Scored answer groups from the policy's rollout weights (the interface of
    `rollout.ExperienceMaker`, so every execution mode uses it unchanged)."""

    def __init__(
        self,
        policy: Any,
        reward: WeightedReward,
        prompts: list[str],
        seed: int,
        group_size: int,
        max_new_tokens: int,
        temperature: float,
        min_new_tokens: int = 0,
        rollout_weights: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        load_rollout_state: Callable[[dict[str, torch.Tensor]], None] | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        backend: AnswerBackend | None = None,
        questions: str = DEFAULT_QUESTIONS,
        style: QuestionStyle = PLAIN,
    ) -> None:
        # a set that names no questions is refused now, not at the first step
        texts = [question_text(p, questions, style) for p in prompts[:1000]]
        if min_new_tokens > max_new_tokens:
            raise ConfigError(
                f"algorithm.min_new_tokens={min_new_tokens} is above "
                f"algorithm.max_new_tokens={max_new_tokens}"
            )
        model = policy.model
        question = max(model.tokenize(texts), key=len)
        span = getattr(model, "prompt_length", None)  # where positions can outrun tokens (3D rope)
        longest = span(question) if span is not None else model.media_tokens + len(question)
        limit = int(model.lm.config.get_text_config().max_position_embeddings)
        if longest + max_new_tokens > limit:
            raise ConfigError(
                f"algorithm.max_new_tokens={max_new_tokens}: the longest prompt takes {longest} positions "
                f"(clip and question) and the model has {limit}; set it to at most {limit - longest}"
            )
        self.policy, self.reward, self.prompts, self.seed = policy, reward, prompts, seed
        self.group_size, self.max_new_tokens, self.temperature = group_size, max_new_tokens, temperature
        self.min_new_tokens = min_new_tokens
        self.rollout_weights = rollout_weights
        self._load_rollout_state = load_rollout_state
        self.autocast = autocast  # sampling's precision: the trainer recomputes log-probs in the same one
        self.backend = backend or HfAnswers()  # what samples the answers (answer_backends.py)
        self.questions = questions  # the registered question set the prompts name (data.questions)
        self.style = style  # how a question file's options are rendered (data.choice_format, ...)
        self.annotator = None
        self.last_pending = None
        self.generated_at = 0.0
        self.batch_type = TextRollout

    def load_rollout_state(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._load_rollout_state is None:
            raise RuntimeError("this experience maker was built without a way to load rollout weights")
        self._load_rollout_state(tensors)

    def prompt_at(self, position: int) -> str:
        return stream_prompt(self.prompts, self.seed, position)

    @torch.no_grad()
    def generate(self, prompts: list[str], group_ids: list[int], step: int) -> TextRollout:
        """group_size answers to each prompt's question about its clip (clip and answers keyed by
        (seed, step, group))."""
        model = self.policy.model
        k = self.group_size
        clip = model.clip_format
        batch = [
            ask(p, step_generator(self.seed, step, g, "rollout"), clip, self.questions, self.style)
            for p, g in zip(prompts, group_ids, strict=True)
        ]
        video, audio = model.clip_tensors(batch)
        questions = model.tokenize([x.text for x in batch])
        gens = [
            step_generator(self.seed, step, g * 65536 + j, "answers") for g in group_ids for j in range(k)
        ]
        device = next(model.parameters()).device
        with self.rollout_weights(), self.autocast():  # the towers once per clip, then k answers to each
            each = torch.arange(len(batch)).repeat_interleave(k)
            prompted = selected_prompts(model, video.to(device), audio.to(device), questions, each)
            out = self.backend.sample(
                model,
                prompted.embeds,
                prompted.mask,
                self.max_new_tokens,
                self.temperature,
                gens,
                self.min_new_tokens,
                model.sampling_options(prompted),
            )
        stored = getattr(model, "stored_video", None)  # a model reading bytes keeps bytes (Qwen: uint8)
        video = video if stored is None else stored(video)
        video, audio = video.repeat_interleave(k, 0), audio.repeat_interleave(k, 0)
        ids = [q for q in questions for _ in range(k)]
        width = max(len(q) for q in ids)
        return TextRollout(
            prompts=[p for p in prompts for _ in range(k)],
            group_ids=torch.tensor(group_ids).repeat_interleave(k),
            video=video,
            audio=audio,
            questions=torch.tensor([q + [model.pad_id] * (width - len(q)) for q in ids]),
            question_mask=torch.tensor([[True] * len(q) + [False] * (width - len(q)) for q in ids]),
            answers=out.tokens.cpu(),
            answer_mask=out.mask.cpu(),
            behaviour_logp=out.log_probs.cpu(),
            truncated=out.truncated.cpu(),
        )

    def make_step(
        self, step: int, prompts: list[str], group_ids: list[int]
    ) -> tuple[TextRollout, ScoreResult]:
        rollout = self.generate(prompts, group_ids, step)
        self.generated_at = time.perf_counter()
        return rollout, self.reward(answer_media(self.policy, rollout), rollout.prompts, check=False)

    def make_group(self, position: int) -> tuple[TextRollout, ScoreResult]:
        rollout = self.generate([self.prompt_at(position)], [position], 0)
        return rollout, self.reward(answer_media(self.policy, rollout), rollout.prompts, check=False)

    def metrics(self, pending: PendingExtras | None = None) -> dict[str, float]:
        """Nothing: the answers' lengths are logged by the GSPO update from the answers it trains
        (so every execution mode logs them, not only the colocated one)."""
        return {}

    def totals(self) -> dict[str, float]:
        return {}
