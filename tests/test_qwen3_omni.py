"""model.family=qwen3_omni: GSPO on Qwen3-Omni-MoE's thinker, tested on a tiny random-init one
(tests/qwen3_omni_tiny.py), as tests/test_qwen_omni.py tests qwen2_5_omni. The behaviour log-probs
recorded at sampling equal the teacher-forced recompute and the thinker's own forward from token
ids and processor tensors (its deepstack features included); a colocated run on the shipped
question file trains on policy and resumes equal; LoRA stays on the language model's attention.

The tiny model's clip format is the shipped files' (8 fps, 0.5 s, mono 8000 Hz; frames of 32 pixels,
the vision tower's patch being 16): nothing resamples audio.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.config import ConfigError, ModelConfig, load_config
from omni_diffusion_rl.experience.text_sampling import sample_answers
from omni_diffusion_rl.models import (
    build_nft_policy,
    build_policy,
    families,  # noqa: F401 - registers the qwen3_omni family
)
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import step_records, trained_adapter_norm
from .qwen3_omni_tiny import FRAME_SIZE, save_tiny_qwen3_omni
from .test_qwen_omni import MOVING, SMALL_STEP, asked_pair
from .test_qwen_omni import overrides as qwen2_5_overrides

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values"),
]
OPTIONS = {"fps": 8.0, "seconds": 0.5, "frame_size": FRAME_SIZE}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen3_omni(tmp_path_factory.mktemp("qwen3_omni"))


def model_config(path: Path, **more: object) -> ModelConfig:
    return ModelConfig(family="qwen3_omni", pretrained=str(path), options=dict(OPTIONS), **more)


def overrides(model_dir: Path, run: Path, steps: int, *extra: str) -> list[str]:
    """test_qwen_omni.py's run (the shipped question file, GSPO, 2 questions x 4 answers a step) on
    the qwen3_omni family and its frame size."""
    return [
        *qwen2_5_overrides(model_dir, run, steps, *extra),
        "model.family=qwen3_omni",
        f"model.options={{fps: 8.0, seconds: 0.5, frame_size: {FRAME_SIZE}}}",
    ]


def test_the_family_loads_a_folder_and_checks_its_options(model_dir: Path, tmp_path: Path) -> None:
    from omni_diffusion_rl.models.qwen_omni import Qwen3OmniModel, Qwen3OmniPolicy
    from omni_diffusion_rl.registry import evaluations, models

    assert "qwen3_omni" in models.names() and "qwen3_omni" in evaluations.names()
    policy, targets = build_policy(model_config(model_dir))
    assert isinstance(policy, Qwen3OmniPolicy) and policy.kind == "answers"
    assert type(policy.model.thinker).__name__ == "Qwen3OmniMoeThinkerForConditionalGeneration"
    # the attention projections of the 2 layers (the MoE experts are fused 3D weights: not adapted)
    assert len(targets) == 2 * 4 and all(t.startswith("model.language_model.layers.") for t in targets)
    assert {t.rsplit(".", 1)[-1] for t in targets} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    clip = policy.model.clip_format
    assert (clip.fps, clip.sample_rate, clip.seconds, clip.channels) == (8.0, 8000, 0.5, 1)
    with pytest.raises(ConfigError, match="colour unknown to qwen3_omni"):
        build_policy(ModelConfig(family="qwen3_omni", pretrained=str(model_dir), options={"colour": 1}))
    cfg = load_config(None, overrides(model_dir, tmp_path / "run", 1))  # the config check passes
    assert cfg.model.family == "qwen3_omni"
    policy.model.save_pretrained(tmp_path / "again")
    again = Qwen3OmniModel.from_pretrained(tmp_path / "again", **OPTIONS)
    assert again.config == policy.model.config
    video, audio = policy.model.clip_tensors(asked_pair())
    assert video.shape == (2, 4, 3, FRAME_SIZE, FRAME_SIZE) and audio.shape == (2, 1, 4000)
    # 2 temporal patches of one merged 2x2 group; 50 mel frames -> 7 audio tokens (Qwen3's count)
    vis, aud = policy.model._video_inputs(video), policy.model._audio_inputs(audio)
    assert policy.model._media_counts(vis, aud) == ([2, 2], [7, 7])
    # Qwen3-Omni's marker names, read from the tokenizer: placed in the prompt, never sampled
    tokenizer = policy.model.tokenizer
    prompt = tokenizer.convert_ids_to_tokens(policy.model._prompt_ids([], 2, 7))
    assert prompt.count("<|video_pad|>") == 2 and prompt.count("<|audio_pad|>") == 7
    assert "<|vision_start|>" in prompt and "<|AUDIO|>" not in tokenizer.get_vocab()
    markers = tokenizer.convert_tokens_to_ids(["<|audio_pad|>", "<|video_pad|>", "<|audio_start|>"])
    assert set(markers) <= set(policy.model.suppressed.tolist())


def test_behaviour_log_probs_equal_the_recompute_and_the_thinkers_own_forward(model_dir: Path) -> None:
    policy, _ = build_policy(model_config(model_dir))
    model = policy.model
    asked = asked_pair()
    video, audio = model.clip_tensors(asked)
    questions = model.tokenize([q.text for q in asked])
    prompted = model.prompt(video, audio, questions)
    assert prompted.positions.shape == (3, 2, prompted.embeds.shape[1])
    assert prompted.visual_mask is not None and prompted.visual_mask.sum(-1).tolist() == [2, 2]
    assert len(prompted.deepstack) == 1 and prompted.deepstack[0].shape == (4, prompted.embeds.shape[-1])
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    with torch.no_grad():
        out = sample_answers(
            model.lm, prompted.embeds, prompted.mask, model.eos_id, model.pad_id, 8, 1.0,
            generators=gens, min_new_tokens=2, **model.sampling_options(prompted),
        )  # fmt: skip
        recomputed = model.answer_log_probs(prompted, out.tokens, out.mask, 1.0, 2)
        # the deepstack features matter: without them the recompute is another distribution
        bare = type(prompted)(prompted.embeds, prompted.mask, prompted.positions, prompted.next_positions)
        without = model.answer_log_probs(bare, out.tokens, out.mask, 1.0, 2)
    gap = float(((recomputed - out.log_probs).abs() * out.mask).max())
    print(f"qwen3_omni sampler vs recompute: max |logp gap| = {gap:.2e}")
    assert gap < 1e-4, gap
    assert float(((without - out.log_probs).abs() * out.mask).max()) > 1e-3
    assert not torch.isin(out.tokens[out.mask], model.suppressed).any()  # no placeholder sampled
    # the thinker's own path: token ids and processor tensors, its own 3D positions and deepstack
    vis, aud = model._video_inputs(video), model._audio_inputs(audio)
    n_video, n_audio = model._media_counts(vis, aud)
    rows = [
        model._prompt_ids(q, v, a) + t[m].tolist()
        for q, v, a, t, m in zip(questions, n_video, n_audio, out.tokens, out.mask, strict=True)
    ]
    width = max(map(len, rows))
    ids = torch.tensor([[model.pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        logits = model.thinker(input_ids=ids, attention_mask=mask, use_cache=False, **vis, **aud).logits
    for i, (t, m) in enumerate(zip(out.tokens, out.mask, strict=True)):
        n = int(m.sum())
        row_logits = logits[i, width - n - 1 : width - 1].float()
        row_logits[:, model.suppressed] = float("-inf")
        row_logits[:2, model.eos_id] = float("-inf")
        own = torch.log_softmax(row_logits, -1).gather(-1, t[:n, None]).squeeze(-1)
        assert torch.allclose(own, out.log_probs[i, :n], atol=1e-4), (own, out.log_probs[i, :n])


def test_lora_goes_into_the_language_models_attention_only(model_dir: Path) -> None:
    policy = build_nft_policy(model_config(model_dir, lora_rank=2))
    adapted = [n for n, m in policy.transformer.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 2 * 4
    assert all(n.startswith("thinker.model.language_model.layers.") for n in adapted), adapted
    assert all(".self_attn." in n for n in adapted), adapted
    lora = [n for n, _ in policy.transformer.named_parameters() if "lora_" in n]
    assert lora and not any("audio_tower" in n or "visual" in n or ".mlp." in n for n in lora), lora
    # the towers share the projection names: none of theirs is wrapped
    towers = [n for n, m in policy.transformer.named_modules() if "audio_tower" in n or "visual" in n]
    assert any(n.endswith(("q_proj", "qkv")) for n in towers)
    assert not any(hasattr(policy.transformer.get_submodule(n), "lora_A") for n in towers)


@pytest.fixture(scope="module")
def trained(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Two colocated steps whose adapter moves (the length reward), so step 2 samples with what
    step 1 trained."""
    run = tmp_path_factory.mktemp("qwen3_run") / "run"
    summary = Trainer(load_config(None, overrides(model_dir, run, 2, "data.eval_samples=8", MOVING))).fit()
    return run, summary


def test_gspo_trains_colocated_on_the_question_file(trained: tuple[Path, dict]) -> None:
    run, summary = trained
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["grad_norm"] > 0 and trained_adapter_norm(run) > 0  # step 1's update moved the adapter
    gaps = [r["gspo/logp_gap"] for r in rows]  # step 2's answers: sampled with step 1's weights
    print(f"qwen3_omni GSPO gspo/logp_gap per step: {gaps}")
    assert all(g < 1e-4 for g in gaps), gaps
    assert all(abs(r["gspo/ratio_mean"] - 1) < 1e-4 for r in rows)
    assert all(0 < r["answers/mean_tokens"] <= 4 for r in rows)
    samples = summary["samples"]  # every sample accounted: generated, trained, none dropped
    assert samples["generated"] == samples["trained"] == 2 * 2 * 4, samples
    assert not any(v for k, v in samples.items() if k.startswith("dropped/")), samples
    for when in ("before", "after"):
        assert {"greedy", "sampled"} <= set(summary[f"heldout_accuracy_{when}"])


def test_gspo_resumes_equal(model_dir: Path, tmp_path: Path) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    off = "train.eval_at_start_and_end=false"
    Trainer(load_config(None, overrides(model_dir, whole, 3, off, MOVING, SMALL_STEP))).fit()
    Trainer(
        load_config(None, overrides(model_dir, split, 2, off, MOVING, SMALL_STEP, "train.checkpoint_every=2"))
    ).fit()
    resumed = Trainer(load_config(None, overrides(model_dir, split, 3, off, MOVING, SMALL_STEP)))
    resumed.fit(resume=str(split / "checkpoints"))
    a, b = step_records(whole), step_records(split)
    assert [r["step"] for r in b] == [1, 2, 3] and all(r["grad_norm"] > 0 for r in a)
    assert all(r["gspo/logp_gap"] < 1e-4 for r in a + b)
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=1e-5, abs=1e-9)
    assert a[-1]["reward/mean"] == pytest.approx(b[-1]["reward/mean"], abs=1e-6)


@pytest.fixture(scope="module")
def moved(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step run whose adapter moved (the length reward), checkpointed."""
    run = tmp_path_factory.mktemp("qwen3_moved") / "run"
    Trainer(
        load_config(None, overrides(model_dir, run, 1, MOVING, "train.eval_at_start_and_end=false"))
    ).fit()
    return run


def test_peft_export_loads_onto_the_bare_thinker(moved: Path, model_dir: Path, tmp_path: Path) -> None:
    """peft rewrites a MoE model's regex targets into leaf names (docs/research/qwen_omni.md 5): the
    exported adapter, loaded by PeftModel, still adapts the language model's attention only."""
    from peft import PeftModel
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

    from omni_diffusion_rl.export import export_adapter
    from omni_diffusion_rl.inference import load_policy

    out = export_adapter(moved / "checkpoints", tmp_path / "export", "peft")
    loaded = load_policy(moved / "checkpoints")
    base = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    adapted = [n for n, m in peft_model.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 2 * 4 and all(".language_model.layers." in n for n in adapted), adapted
    ids = torch.tensor([[5, 20, 40, 60, 80, 100, 2]])
    with torch.no_grad():
        ours = loaded.model.thinker(input_ids=ids).logits
        theirs = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids).logits
    assert (ours - plain).abs().max() > 1e-6  # the adapter moved the model
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_a_whole_qwen3_omni_folder_gives_its_thinker(model_dir: Path, tmp_path: Path) -> None:
    """Qwen's own folders hold the whole model (config.json of model_type qwen3_omni_moe with a
    thinker_config, weights under `thinker.`; talker and code2wav besides): the thinker alone loads."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    whole = tmp_path / "Qwen3-Omni"
    shutil.copytree(model_dir, whole)
    thinker = json.loads((whole / "config.json").read_text())
    config = {"model_type": "qwen3_omni_moe", "thinker_config": thinker, "enable_audio_output": True}
    (whole / "config.json").write_text(json.dumps(config))
    weights = load_file(str(whole / "model.safetensors"))
    save_file({f"thinker.{k}": v for k, v in weights.items()}, str(whole / "model.safetensors"))
    ours, _ = build_policy(model_config(model_dir))
    theirs, _ = build_policy(model_config(whole))
    assert theirs.model.config == ours.model.config
    ids = torch.tensor([[5, 20, 40, 60]])
    with torch.no_grad():
        assert torch.equal(
            theirs.model.thinker(input_ids=ids).logits, ours.model.thinker(input_ids=ids).logits
        )


def test_a_bf16_base_trains_on_policy(model_dir: Path, tmp_path: Path) -> None:
    """model.base_dtype=bf16 (a real thinker's weights) with bf16 mixed precision: sampling and the
    recompute (deepstack features cast to the embeddings' dtype) agree."""
    extra = ("model.base_dtype=bf16", "train.mixed_precision=bf16", "train.eval_at_start_and_end=false")
    run = tmp_path / "run"
    Trainer(load_config(None, overrides(model_dir, run, 1, MOVING, *extra))).fit()
    (row,) = step_records(run)
    print(f"qwen3_omni bf16 gspo/logp_gap: {row['gspo/logp_gap']:.2e}")
    assert row["gspo/logp_gap"] < 1e-2 and row["grad_norm"] > 0, row
