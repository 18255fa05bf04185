"""The rollout answer backends: what the vllm backend hands vLLM (the base LM's weights and each
rollout adapter in peft's layout) is the policy's rollout model, checked by loading it back with
transformers and peft; vLLM missing is named with its install; vLLM's completions become Answers with
truncation flagged and an aborted request an error. `test_vllm_*` run only where vLLM is installed
(not in CI: see the GSPO section of docs/algorithms.md for how it was checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omni_diffusion_rl.config import ConfigError, ModelConfig, load_config
from omni_diffusion_rl.experience.answer_backends import (
    answers_from_vllm,
    export_base_lm,
    peft_adapter_tensors,
    vllm_lora_rank,
    write_peft_adapter,
)
from omni_diffusion_rl.models import build_nft_policy, lora
from omni_diffusion_rl.preflight import MISSING, preflight
from omni_diffusion_rl.trainers.trainer import Trainer

from .test_gspo_loop import gspo_overrides, omni_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return omni_model_dir(tmp_path_factory.mktemp("omni"))


def randomised_policy(model_dir: Path):  # noqa: ANN201
    """The tiny omni policy with its two adapters, the rollout (`old`) one set to random values."""
    policy = build_nft_policy(
        ModelConfig(family="tiny_omni", pretrained=str(model_dir), lora_rank=4, lora_alpha=8.0)
    )
    torch.manual_seed(1)
    for p in lora.adapter_parameters(policy.transformer, lora.OLD).values():
        p.data = torch.randn_like(p) * 0.2
    return policy


def test_the_exported_base_and_adapter_are_the_rollout_model(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    policy = randomised_policy(model_dir)
    model = policy.model
    export_base_lm(model.lm, model.tokenizer, tmp_path / "base")
    state = lora.adapter_state_dict(policy.transformer, lora.OLD)
    write_peft_adapter(state, 4, 8.0, tmp_path / "adapter")
    assert AutoTokenizer.from_pretrained(str(tmp_path / "base")).get_vocab() == model.tokenizer.get_vocab()

    embeds = torch.randn(2, 7, model.lm.config.hidden_size)
    served = PeftModel.from_pretrained(
        Qwen2ForCausalLM.from_pretrained(str(tmp_path / "base")), str(tmp_path / "adapter")
    ).eval()
    with torch.no_grad():
        got = served(inputs_embeds=embeds).logits
        with lora.using_adapter(policy.transformer, lora.OLD):
            want = model.lm(inputs_embeds=embeds).logits
        with lora.adapters_disabled(policy.transformer):
            base = model.lm(inputs_embeds=embeds).logits
    assert float((got - want).abs().max()) < 1e-4
    assert float((got - base).abs().max()) > 1e-2  # the adapter does change the answers


def test_lora_outside_the_language_model_cannot_be_served() -> None:
    state = {"encoder.video_proj.lora_A.old.weight": torch.zeros(4, 8)}
    with pytest.raises(ConfigError, match="language model only.*encoder.video_proj"):
        peft_adapter_tensors(state)
    with pytest.raises(ValueError, match="not a LoRA parameter"):
        peft_adapter_tensors({"lm.model.norm.weight": torch.zeros(3)})


def test_lora_ranks_round_up_to_what_vllm_serves() -> None:
    assert [vllm_lora_rank(r) for r in (1, 4, 16, 17, 512)] == [1, 8, 16, 32, 512]
    with pytest.raises(ConfigError, match="up to 512"):
        vllm_lora_rank(600)


def completion(ids: list[int], reason: str) -> SimpleNamespace:
    """vLLM's CompletionOutput fields the backend reads (token ids with the stop token, one
    {token: Logprob} per token, the finish reason)."""
    logprobs = [{t: SimpleNamespace(logprob=-0.5 * (k + 1))} for k, t in enumerate(ids)]
    return SimpleNamespace(token_ids=ids, logprobs=logprobs, finish_reason=reason)


def test_vllm_completions_become_padded_answers_with_truncation_flagged() -> None:
    # an end token as the last allowed token is an ended answer, whichever reason vLLM gives
    done = [completion([5, 1], "stop"), completion([7, 8, 9], "length"), completion([4, 1], "length")]
    answers = answers_from_vllm(done, 1, 0, torch.device("cpu"))
    assert answers.tokens.tolist() == [[5, 1, 0], [7, 8, 9], [4, 1, 0]]
    assert answers.lengths.tolist() == [2, 3, 2]
    assert answers.truncated.tolist() == [False, True, False]
    assert answers.log_probs[0].tolist() == [-0.5, -1.0, 0.0]
    with pytest.raises(RuntimeError, match="did not finish 1 answers.*abort"):
        answers_from_vllm([completion([5, 1], "stop"), completion([], "abort")], 1, 0, torch.device("cpu"))


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_vllm_missing_is_named_with_its_install(model_dir: Path, tmp_path: Path) -> None:
    overrides = gspo_overrides(model_dir, tmp_path / "run", 1, "algorithm.rollout_backend=vllm")
    with pytest.raises(
        ConfigError, match="vLLM is not installed.*pip install 'vllm>=0.11'.*rollout_backend=hf"
    ):
        Trainer(load_config(None, overrides))
    findings = {f.what: f for f in preflight(load_config(None, overrides))}
    assert findings["algorithm.rollout_backend"].status == MISSING
    assert "pip install" in findings["algorithm.rollout_backend"].detail


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (a separate install)")
def test_vllm_answers_are_on_policy_and_follow_each_adapter_version(model_dir: Path, tmp_path: Path) -> None:
    """GSPO colocated with vLLM sampling: the trainer's recomputed log-probs equal vLLM's (fp32), so
    each step's new rollout adapter was served, and forced-long answers keep their mask."""
    run = tmp_path / "run"
    extra = (
        "algorithm.rollout_backend=vllm",
        "algorithm.vllm_enforce_eager=true",
        "algorithm.min_new_tokens=2",
    )
    overrides = gspo_overrides(model_dir, run, 3, *extra, "train.eval_at_start_and_end=false")
    trainer = Trainer(load_config(None, overrides))
    trainer.fit()
    from .helpers import step_records

    records = step_records(run)
    assert len(records) == 3
    assert all(r["gspo/logp_gap"] < 1e-4 for r in records), [r["gspo/logp_gap"] for r in records]
    assert all(r["answers/mean_tokens"] >= 2 for r in records)
    assert (
        trainer.experience.backend.version == 3
    )  # one adapter version per step (the copy after each update)


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (a separate install)")
def test_vllm_log_probs_follow_each_published_adapter(model_dir: Path) -> None:
    """vLLM's behaviour log-probs equal the policy's own under the adapter served at that call, for
    two different adapters in turn (a stale adapter would fail the second comparison)."""
    from omni_diffusion_rl.experience.answer_backends import VllmAnswers, VllmOptions
    from omni_diffusion_rl.prompts import load_prompts
    from omni_diffusion_rl.world.avqa import parse_question, render_clips
    from omni_diffusion_rl.world.tiny_clip import synthesize_audio

    policy = randomised_policy(model_dir)
    model = policy.model
    questions = [parse_question(p) for p in load_prompts("builtin:tiny_avqa")[:4]]
    video, audio = render_clips(questions, torch.Generator().manual_seed(0))
    with torch.no_grad():
        prompted = model.prompt(video, synthesize_audio(audio), model.tokenize([q.text for q in questions]))
    backend = VllmAnswers(
        lambda: lora.adapter_state_dict(policy.transformer, lora.OLD),
        VllmOptions(4, 8.0, dtype="float32", enforce_eager=True),
    )
    gaps = []
    for version in (1, 2):
        if version == 2:  # a new rollout adapter, as after an update or a weight sync
            for p in lora.adapter_parameters(policy.transformer, lora.OLD).values():
                p.data = torch.randn_like(p) * 0.2
        gens = [torch.Generator().manual_seed(10 + i) for i in range(4)]
        answers = backend.sample(model, prompted.embeds, prompted.mask, 6, 1.0, gens, 2)
        assert backend.version == version
        with torch.no_grad(), lora.using_adapter(policy.transformer, lora.OLD):
            mine = model.answer_log_probs(prompted, answers.tokens, answers.mask, 1.0, 2)
        gaps.append(float((mine - answers.log_probs)[answers.mask].abs().max()))
        assert bool((answers.lengths >= 2).all())
    backend.close()  # a closed backend starts a new engine and publishes the adapter to it afresh
    answers = backend.sample(model, prompted.embeds, prompted.mask, 6, 1.0, gens, 2)
    with torch.no_grad(), lora.using_adapter(policy.transformer, lora.OLD):
        mine = model.answer_log_probs(prompted, answers.tokens, answers.mask, 1.0, 2)
    gaps.append(float((mine - answers.log_probs)[answers.mask].abs().max()))
    backend.close()
    assert backend.version == 3
    assert max(gaps) < 1e-4, gaps


def test_answer_lengths_that_do_not_fit_the_model_are_refused_by_name(
    model_dir: Path, tmp_path: Path
) -> None:
    too_long = gspo_overrides(model_dir, tmp_path / "a", 1, "algorithm.max_new_tokens=90")
    with pytest.raises(ConfigError, match=r"algorithm.max_new_tokens=90: .* set it to at most \d+"):
        Trainer(load_config(None, too_long))
    forced_past_limit = gspo_overrides(model_dir, tmp_path / "b", 1, "algorithm.min_new_tokens=8")
    with pytest.raises(ConfigError, match="min_new_tokens=8 is above algorithm.max_new_tokens=6"):
        Trainer(load_config(None, forced_past_limit))
