"""Where rollout answers are sampled: `hf` (transformers with a KV cache, `text_sampling.py`, the
default) or `vllm` (vLLM's engine, optional, for GPU users).

Both take the same inputs, the prompt embeddings of [media | question] that the policy's media
encoder made, and return `text_sampling.Answers` with the behaviour log-probs GSPO's ratio is taken
against. With vLLM the prompts enter as `prompt_embeds`, the LM's weights are the base's, and the
rollout adapter is served as a LoRA request: each new adapter version is written once (peft's layout)
and gets its own request id, the previous one is removed. vLLM reports log-probs after temperature and
the min-tokens mask (`logprobs_mode=processed_logprobs`), the distribution the trainer recomputes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..algorithm_options import ANSWER_BACKENDS
from ..config import ConfigError, ExperimentConfig
from ..preflight import vllm_problem
from .text_sampling import Answers, sample_answers

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA kernels are built for


class AnswerBackend(Protocol):
    """`options`: the model's own sampling inputs (`model.sampling_options(prompted)`: prompt
    positions, suppressed tokens), given to `text_sampling.sample_answers`."""

    def sample(
        self,
        model: Any,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        generators: list[torch.Generator],
        min_new_tokens: int,
        options: dict[str, Any] | None = None,
    ) -> Answers: ...

    def close(self) -> None: ...


class HfAnswers:
    """transformers generation in the policy's own process and weights (the rollout adapter active)."""

    def sample(
        self,
        model: Any,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        generators: list[torch.Generator],
        min_new_tokens: int,
        options: dict[str, Any] | None = None,
    ) -> Answers:
        return sample_answers(
            model.lm,
            embeds,
            mask,
            model.eos_id,
            model.pad_id,
            max_new_tokens,
            temperature,
            generators=generators,
            min_new_tokens=min_new_tokens,
            **(options or {}),
        )

    def close(self) -> None:
        """Nothing to release: it samples with the policy itself."""


def require_vllm() -> None:
    """Refuse, naming the install, when vLLM is missing or older than prompt-embedding support."""
    problem = vllm_problem()
    if problem is not None:
        raise ConfigError(f"algorithm.rollout_backend=vllm: {problem}")


def vllm_lora_rank(rank: int) -> int:
    """The smallest LoRA rank vLLM serves that holds `rank` (its `max_lora_rank`)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"model.lora_rank={rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def peft_adapter_tensors(state: dict[str, torch.Tensor], lm_prefix: str = "lm.") -> dict[str, torch.Tensor]:
    """One adapter of the policy (keys `<lm_prefix>...q_proj.lora_A.<adapter>.weight`, as
    `lora.adapter_state_dict` gives them) in peft's saved layout for the LM alone
    (`base_model.model....q_proj.lora_A.weight`), which vLLM loads. LoRA outside the LM (on the media
    encoder) cannot be served: it is refused by name."""
    out: dict[str, torch.Tensor] = {}
    outside = sorted(k for k in state if not k.startswith(lm_prefix))
    if outside:
        raise ConfigError(
            f"algorithm.rollout_backend=vllm serves LoRA on the language model only; the adapter also "
            f"adapts {outside[:3]} (set model.lora_targets to the LM's projections)"
        )
    for key, value in state.items():
        parts = key.removeprefix(lm_prefix).split(".")
        if len(parts) < 3 or not parts[-3].startswith("lora_"):
            raise ValueError(f"{key!r} is not a LoRA parameter of a named adapter (...lora_A.<name>.weight)")
        del parts[-2]  # the adapter's name: peft's saved files have none
        out["base_model.model." + ".".join(parts)] = value.detach().float().cpu().contiguous()
    return out


def export_base_lm(lm: torch.nn.Module, tokenizer: Any, path: Path) -> None:
    """The LM's base weights (its LoRA layers unwrapped, adapters dropped) as a transformers directory
    with the tokenizer beside them: what vLLM loads."""
    state = {k.replace(".base_layer.", "."): v for k, v in lm.state_dict().items() if "lora_" not in k}
    lm.save_pretrained(path, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(path)


def write_peft_adapter(state: dict[str, torch.Tensor], rank: int, alpha: float, path: Path) -> None:
    """One adapter of the policy as a peft adapter directory of the LM alone (config and
    safetensors), written to a staging name and renamed into place."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors = peft_adapter_tensors(state)
    targets = sorted({k.split(".")[-3] for k in tensors})  # the adapted modules' short names
    staging = path.with_name(path.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets).save_pretrained(str(staging))
    save_file(tensors, str(staging / "adapter_model.safetensors"))
    staging.rename(path)


@dataclass(frozen=True)
class VllmOptions:
    lora_rank: int
    lora_alpha: float
    dtype: str = "auto"  # vLLM's: "float32" matches an fp32 trainer; "bfloat16" a bf16 one
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = False


class VllmAnswers:
    """Answers sampled by a vLLM engine started on first use in the process that generates; the
    rollout adapter comes from `adapter_state()` at every call and is published as a new LoRA request
    when it changed (a weight sync, or the colocated mode's copy after each update)."""

    def __init__(self, adapter_state: Callable[[], dict[str, torch.Tensor]], options: VllmOptions) -> None:
        require_vllm()
        self.adapter_state, self.options = adapter_state, options
        self.max_lora_rank = vllm_lora_rank(options.lora_rank)
        peft_adapter_tensors(adapter_state())  # LoRA outside the LM is refused now, not at the first step
        self._engine: Any = None
        self._published: dict[str, torch.Tensor] | None = None
        self._request: Any = None
        self.version = 0
        self._workdir: Path | None = None  # made with the engine: a process that never generates has none

    def _start(self, model: Any) -> Any:
        from vllm import LLM

        self._workdir = Path(tempfile.mkdtemp(prefix="odrl-vllm-"))
        weakref.finalize(self, shutil.rmtree, self._workdir, True)
        base = self._workdir / "base"
        export_base_lm(model.lm, model.tokenizer, base)
        o = self.options
        return LLM(
            model=str(base),
            enable_prompt_embeds=True,
            enable_lora=True,
            max_lora_rank=self.max_lora_rank,
            max_loras=1,
            logprobs_mode="processed_logprobs",
            dtype=o.dtype,
            enforce_eager=o.enforce_eager,
            gpu_memory_utilization=o.gpu_memory_utilization,
            max_model_len=int(model.lm.config.max_position_embeddings),
        )

    def _lora_request(self) -> Any:
        """The request of the current rollout adapter, publishing a new version when it changed."""
        from vllm.lora.request import LoRARequest

        state = self.adapter_state()
        same = self._published is not None and state.keys() == self._published.keys()
        if same and all(torch.equal(v, self._published[k]) for k, v in state.items()):  # type: ignore[index]
            return self._request
        self.version += 1
        assert self._workdir is not None  # the engine was started
        path = self._workdir / f"adapter-v{self.version}"
        write_peft_adapter(state, self.options.lora_rank, self.options.lora_alpha, path)
        previous = self._request
        self._request = LoRARequest(f"policy-v{self.version}", self.version, str(path))
        self._published = {k: v.detach().clone() for k, v in state.items()}
        if previous is not None:
            self._engine.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        return self._request

    def sample(
        self,
        model: Any,
        embeds: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        temperature: float,
        generators: list[torch.Generator],
        min_new_tokens: int,
        options: dict[str, Any] | None = None,
    ) -> Answers:
        from vllm import SamplingParams

        if options:
            raise ConfigError(
                "algorithm.rollout_backend=vllm serves models whose prompts take plain positions; this "
                f"model's prompts carry their own ({', '.join(sorted(options))}): use rollout_backend=hf"
            )
        if self._engine is None:
            self._engine = self._start(model)
        request = self._lora_request()
        prompts = [
            {"prompt_embeds": row[m.bool()].detach().float().cpu()}
            for row, m in zip(embeds, mask, strict=True)
        ]
        params = [
            SamplingParams(
                temperature=temperature,
                max_tokens=max_new_tokens,
                min_tokens=min_new_tokens,
                seed=int(g.initial_seed()) % (1 << 63),
                logprobs=0,
                stop_token_ids=[model.eos_id],
                detokenize=False,
            )
            for g in generators
        ]
        outputs = self._engine.generate(prompts, params, lora_request=request, use_tqdm=False)
        return answers_from_vllm([o.outputs[0] for o in outputs], model.eos_id, model.pad_id, embeds.device)

    def close(self) -> None:
        """Drop the engine (vLLM shuts its processes down) and the adapter files; a later call starts
        a new engine and publishes the adapter to it afresh."""
        self._engine, self._request, self._published = None, None, None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)


def answers_from_vllm(completions: list[Any], eos_id: int, pad_id: int, device: torch.device) -> Answers:
    """vLLM completions (token ids with the stop token, one log-prob dict per token, a finish reason)
    as padded `Answers`, truncated when no end token came (hf's rule, whatever order a vLLM version
    checks its stop conditions in); an aborted request is an error, not an empty answer."""
    aborted = [i for i, c in enumerate(completions) if c.finish_reason not in ("stop", "length")]
    if aborted:
        reasons = sorted({str(completions[i].finish_reason) for i in aborted})
        raise RuntimeError(f"vLLM did not finish {len(aborted)} answers (finish reasons {reasons})")
    width = max(1, max(len(c.token_ids) for c in completions))
    tokens = torch.full((len(completions), width), pad_id, dtype=torch.long)
    log_probs = torch.zeros(len(completions), width)
    answer_mask = torch.zeros(len(completions), width, dtype=torch.bool)
    for i, c in enumerate(completions):
        ids = list(c.token_ids)
        tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[i, : len(ids)] = torch.tensor(
            [step[t].logprob for t, step in zip(ids, c.logprobs, strict=True)]
        )
        answer_mask[i, : len(ids)] = True
    truncated = torch.tensor([eos_id not in list(c.token_ids) for c in completions])
    return Answers(tokens.to(device), answer_mask.to(device), log_probs.to(device), truncated.to(device))


def answer_backend(
    cfg: ExperimentConfig, precision: str, adapter_state: Callable[[], dict[str, torch.Tensor]]
) -> AnswerBackend:
    """The rollout answer sampler `algorithm.rollout_backend` names; `adapter_state()` gives the
    rollout adapter's tensors (the vllm backend serves them; hf samples in the policy itself)."""
    a = cfg.algorithm
    if a.rollout_backend == "hf":
        return HfAnswers()
    if a.rollout_backend == "vllm":
        if torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                "algorithm.rollout_backend=vllm runs one engine per process, and vLLM starts each on the "
                "first GPU: with several processes they would share it (not supported yet). Run one "
                "process (--nproc 1) or use algorithm.rollout_backend=hf"
            )
        options = VllmOptions(
            cfg.model.lora_rank,
            cfg.model.lora_alpha,
            dtype="bfloat16" if precision == "bf16" else "float32",
            gpu_memory_utilization=a.vllm_gpu_memory,
            enforce_eager=a.vllm_enforce_eager,
        )
        return VllmAnswers(adapter_state, options)
    raise ConfigError(f"algorithm.rollout_backend={a.rollout_backend!r}: choose one of {ANSWER_BACKENDS}")
