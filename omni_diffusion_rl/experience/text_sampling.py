"""Answers sampled token by token with transformers' KV cache, batched, recording each sampled
token's log-probability under the sampling policy (the behaviour log-probs GSPO's ratio is taken
against). Seeded per row: a row's answer does not depend on the rows batched with it."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Answers:
    tokens: torch.Tensor  # [B, L] sampled ids (pad after the end)
    mask: torch.Tensor  # [B, L] bool: the answer's tokens, its end-of-sequence token included
    log_probs: torch.Tensor  # [B, L] behaviour log-probs of the sampled tokens (0 on padding)
    truncated: torch.Tensor  # [B] bool: stopped by the token limit before an end-of-sequence token

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(-1)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[B, L] log pi(token_l | everything before it), from the logits [B, L, V] that predicted each
    token (position l's logits come from the model's output at the position before it)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


def _cache_name(lm: torch.nn.Module) -> str:
    """transformers 5.2x calls the KV cache argument and output `cache`, earlier ones `past_key_values`."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def _prefill_inputs(lm: torch.nn.Module, prompt_inputs: dict[str, Any] | None) -> dict[str, Any]:
    """The prompt's forward's extra inputs, and `logits_to_keep=1` where the model takes it (the
    full-vocabulary head on the last position only: the first answer token's)."""
    keep = "logits_to_keep" in inspect.signature(lm.forward).parameters
    return {**(prompt_inputs or {}), **({"logits_to_keep": 1} if keep else {})}


@torch.no_grad()
def sample_answers(
    lm: torch.nn.Module,
    embeds: torch.Tensor,
    mask: torch.Tensor,
    eos_id: int,
    pad_id: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    greedy: bool = False,
    generators: list[torch.Generator] | None = None,
    min_new_tokens: int = 0,
    positions: torch.Tensor | None = None,
    next_positions: torch.Tensor | None = None,
    suppress_ids: torch.Tensor | None = None,
    prompt_inputs: dict[str, Any] | None = None,
) -> Answers:
    """Up to `max_new_tokens` tokens after the left-padded prompt `embeds` [B, P, H] / `mask` [B, P].
    `min_new_tokens` forbids the end token before that many tokens (the "forced long answers" of
    the modes benchmark). `generators`: one per row for sampling (greedy needs none).

    `positions`: the prompt's position ids, [B, P] or [R, B, P] for a model with several position
    rows (Qwen2.5-Omni's 3D rope); default the count of real tokens before each. `next_positions`
    [B]: the first answer token's position (answer tokens then count up, one id for every row);
    default one past the prompt's last position. `suppress_ids`: tokens never sampled (their
    probability is 0 in the recorded log-probs too). `prompt_inputs`: more inputs of the prompt's
    forward only (Qwen3-Omni's deepstack visual features)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not greedy and (generators is None or len(generators) != len(embeds)):
        raise ValueError("sampling needs one torch.Generator per row (or greedy=True)")
    b = len(embeds)
    mask = mask.long()
    if positions is None:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_name = _cache_name(lm)
    prompt = _prefill_inputs(lm, prompt_inputs)
    out = lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=True, **prompt)
    cache: Any = getattr(out, cache_name)
    logits = out.logits[:, -1]
    if next_positions is None:  # the last prompt token is a real one (left padding)
        next_positions = positions[:, -1] + 1 if positions.ndim == 2 else positions[..., -1].amax(0) + 1
    next_pos = next_positions
    tokens = torch.full((b, max_new_tokens), pad_id, dtype=torch.long, device=embeds.device)
    logp_out = torch.zeros(b, max_new_tokens, device=embeds.device)
    done = torch.zeros(b, dtype=torch.bool, device=embeds.device)
    answer_mask = torch.zeros(b, max_new_tokens, dtype=torch.bool, device=embeds.device)
    for k in range(max_new_tokens):
        scores = logits.float() / temperature
        if suppress_ids is not None:
            scores[:, suppress_ids] = float("-inf")
        if k < min_new_tokens:
            scores[:, eos_id] = float("-inf")
        logp = torch.log_softmax(scores, dim=-1)
        if greedy:
            pick = logp.argmax(-1)
        else:
            probs = logp.exp()
            pick = torch.stack(
                [torch.multinomial(probs[i].cpu(), 1, generator=generators[i])[0] for i in range(b)]  # type: ignore[index]
            ).to(embeds.device)
        live = ~done
        tokens[live, k] = pick[live]
        answer_mask[live, k] = True
        logp_out[live, k] = logp.gather(-1, pick[:, None]).squeeze(-1)[live]
        done = done | (pick == eos_id)
        if bool(done.all()) or k == max_new_tokens - 1:
            break
        mask = torch.cat([mask, live.long()[:, None]], dim=1)
        step = lm(
            input_ids=tokens[:, k : k + 1],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{cache_name: cache},
        )
        cache, logits = getattr(step, cache_name), step.logits[:, -1]
        next_pos = next_pos + 1
    width = int(answer_mask.sum(-1).max())
    return Answers(tokens[:, :width], answer_mask[:, :width], logp_out[:, :width], ~done)


def selected_prompts(
    model: Any, video: torch.Tensor, audio: torch.Tensor, questions: list[list[int]], index: torch.Tensor
) -> Any:
    """The prompts of the clips and questions `index` names (repeats allowed: a group's k answers to
    one clip), the towers run once per clip and the prompts selected (`rows`, gradients flowing
    through); a model of the user's own whose prompts cannot be selected gets each one built."""
    prompted = model.prompt(video, audio, questions)
    if hasattr(prompted, "rows"):
        return prompted.rows(index)
    at = index.to(video.device)
    return model.prompt(video[at], audio[at], [questions[i] for i in index.tolist()])
