"""model.family=qwen2_5_omni: GSPO on Qwen2.5-Omni's thinker, tested on a tiny random-init one
(tests/qwen_omni_tiny.py). The behaviour log-probs recorded at sampling equal the teacher-forced
recompute (and the thinker's own forward from token ids and processor tensors); a colocated run on
the shipped question file trains on policy and resumes equal; LoRA stays in the language model; a
checkpoint of another tokenizer is refused; `odrl export --format peft` loads onto the bare thinker.

The tiny model's clip format is the shipped files' (8 fps, 0.5 s, mono 8000 Hz): its feature
extractor's sampling rate is 8000 (Whisper's mel bank then has empty filters above 4 kHz: a warning,
filtered here), since nothing resamples audio.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.answer_data.questions import AskedQuestion
from omni_diffusion_rl.checkpoint import CheckpointError
from omni_diffusion_rl.config import ConfigError, ModelConfig, load_config
from omni_diffusion_rl.experience.text_sampling import sample_answers
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.models import (
    build_nft_policy,
    build_policy,
    families,  # noqa: F401 - registers the qwen2_5_omni family
)
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import step_records, trained_adapter_norm
from .qwen_omni_tiny import save_tiny_qwen_omni

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values"),
]
QUESTIONS = (
    Path(__file__).resolve().parent.parent / "recipes" / "data" / "tiny_avqa_files" / "questions.jsonl"
)
OPTIONS = {"fps": 8.0, "seconds": 0.5, "frame_size": 28}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen_omni(tmp_path_factory.mktemp("qwen_omni"))


def model_config(path: Path) -> ModelConfig:
    return ModelConfig(family="qwen2_5_omni", pretrained=str(path), options=dict(OPTIONS))


def overrides(model_dir: Path, run: Path, steps: int, *extra: str) -> list[str]:
    return [
        "model.family=qwen2_5_omni",
        f"model.pretrained={model_dir}",
        "model.options={fps: 8.0, seconds: 0.5, frame_size: 28}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "algorithm.name=gspo",
        "algorithm.max_new_tokens=4",
        f"data.prompts={QUESTIONS}",
        f"data.eval_prompts={QUESTIONS}",
        "data.clip_fps=8.0",
        "data.clip_sample_rate=8000",
        "data.clip_seconds=0.5",
        "data.clip_channels=1",
        "data.prompts_per_step=2",
        "data.group_size=4",
        "data.eval_samples=20",
        "reward.weights={answer_exact: 1.0}",
        "eval.metrics=[]",
        f"train.output_dir={run}",
        f"train.steps={steps}",
        "train.preview_every=0",
        "train.progress=false",
        "tracking.wandb=false",
        "optim.lr=5e-2",
        *extra,
    ]


@rewards.register("qwen_test_length", overwrite=True)
class AnswerLength:
    """A random model never answers right (answer_exact is 0 for all, no advantage, no update): the
    answer's length in characters, so groups differ and the adapter moves."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        assert media.text is not None
        return torch.tensor([len(t) / 10 for t in media.text])


MOVING = "reward.weights={answer_exact: 1.0, qwen_test_length: 1.0}"  # with a smaller step:
SMALL_STEP = "optim.lr=5e-3"


def asked_pair() -> list[AskedQuestion]:
    g = torch.Generator().manual_seed(0)
    video, audio = torch.rand(4, 3, 16, 16, generator=g), torch.randn(1, 4000, generator=g) * 0.1
    return [
        AskedQuestion("what colour is the shape ?", "red", "color", video, audio),
        AskedQuestion("which shape is shown ? options : circle square", "circle", "shape", None, None),
    ]


def _tokenizer_json(edit: object) -> object:
    def apply(folder: Path) -> None:
        data = json.loads((folder / "tokenizer.json").read_text())
        edit(data)  # type: ignore[operator]
        (folder / "tokenizer.json").write_text(json.dumps(data))

    return apply


def _preprocessor(**values: object) -> object:
    def apply(folder: Path) -> None:
        data = json.loads((folder / "preprocessor_config.json").read_text())
        (folder / "preprocessor_config.json").write_text(json.dumps({**data, **values}))

    return apply


def _template(text: str) -> object:
    return lambda folder: (folder / "chat_template.jinja").write_text(text)


NESTED_LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
CRAFTED_FOLDERS = {  # a crafted model folder -> what the sentence names (each was a traceback or a hang)
    "looping template": (_template(NESTED_LOOPS), "its chat template cannot be used (DeadlineExceeded"),
    "template syntax": (_template("{% for %}"), "its chat template cannot be used (TemplateSyntaxError"),
    "hop_length 0": (_preprocessor(hop_length=0), "hop_length=0 must be a whole number from 1 to 65536"),
    "n_fft 1e12": (_preprocessor(n_fft=10**12), "n_fft=1000000000000 must be a whole number from 1 to 65536"),
    "patch_size 0": (_preprocessor(patch_size=0), "patch_size=0 must be a whole number from 1 to 1024"),
    "merge_size a string": (_preprocessor(merge_size="2"), "merge_size=2 must be a whole number"),
    "sampling_rate 0": (_preprocessor(sampling_rate=0), "sampling_rate=0 must be a whole number from 1"),
    "size edge 1e12": (_preprocessor(size={"longest_edge": 10**12}), "size.longest_edge=1000000000000"),
    "tokenizer regex": (
        _tokenizer_json(
            lambda t: t.update(
                pre_tokenizer={
                    "type": "Split",
                    "pattern": {"Regex": "("},
                    "behavior": "Isolated",
                    "invert": False,
                }
            )
        ),
        "its tokenizer cannot be used (Exception: Oniguruma error",
    ),
    "tokenizer panic": (  # a Rust panic in the tokenizers library: a BaseException
        _tokenizer_json(
            lambda t: t.update(normalizer={"type": "Precompiled", "precompiled_charsmap": "AAAA"})
        ),
        "its tokenizer cannot be used (PanicException",
    ),
}


@pytest.mark.parametrize("case", list(CRAFTED_FOLDERS))
def test_a_crafted_model_folder_is_a_sentence(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Each crafted value of a model folder is a ModelLoadError naming the folder and what is wrong
    (the looping template is stopped: the bound is lowered here, the template never ends)."""
    from omni_diffusion_rl.models import ModelLoadError, qwen_omni

    monkeypatch.setattr(qwen_omni, "TEMPLATE_RENDER_S", 0.5)
    craft, fragment = CRAFTED_FOLDERS[case]
    folder = Path(shutil.copytree(model_dir, tmp_path / "crafted"))
    craft(folder)  # type: ignore[operator]
    with pytest.raises(ModelLoadError) as refused:
        build_policy(model_config(folder))
    assert fragment in str(refused.value) and f"model.pretrained={folder}" in str(refused.value), (
        refused.value
    )


def test_the_family_loads_a_folder_and_checks_its_options(model_dir: Path, tmp_path: Path) -> None:
    from omni_diffusion_rl.models.qwen_omni import QwenOmniModel, QwenOmniPolicy
    from omni_diffusion_rl.registry import evaluations, models  # found by pyproject's entry points

    assert "qwen2_5_omni" in models.names() and "qwen2_5_omni" in evaluations.names()
    policy, targets = build_policy(model_config(model_dir))
    assert isinstance(policy, QwenOmniPolicy) and policy.kind == "answers"
    assert len(targets) == 2 * 7 and all(t.startswith("model.language_model.layers.") for t in targets)
    clip = policy.model.clip_format
    assert (clip.fps, clip.sample_rate, clip.seconds, clip.channels) == (8.0, 8000, 0.5, 1)
    with pytest.raises(ConfigError, match="colour unknown to qwen2_5_omni"):
        build_policy(ModelConfig(family="qwen2_5_omni", pretrained=str(model_dir), options={"colour": 1}))
    cfg = load_config(None, overrides(model_dir, tmp_path / "run", 1))  # the config check passes
    assert cfg.model.family == "qwen2_5_omni"
    # save_pretrained / from_pretrained round trip: same identity
    policy.model.save_pretrained(tmp_path / "again")
    again = QwenOmniModel.from_pretrained(tmp_path / "again", **OPTIONS)
    assert again.config == policy.model.config
    video, audio = policy.model.clip_tensors(asked_pair())
    assert video.shape == (2, 4, 3, 28, 28) and audio.shape == (2, 1, 4000) and not video[1].any()
    at_16k = AskedQuestion("what colour is the shape ?", "red", "color", None, torch.zeros(1, 8000))
    with pytest.raises(
        ValueError, match="a clip of 4 frames and 8000 samples: the model reads 4 frames and 4000"
    ):
        policy.model.clip_tensors([at_16k])
    with pytest.raises(ValueError, match="reads at most 1 s of sound a clip"):
        QwenOmniModel.from_pretrained(model_dir, **(OPTIONS | {"seconds": 2.0}))
    # a folder whose template comes as chat_template.json (Qwen's own layout) gives the same model
    template = (tmp_path / "again" / "chat_template.jinja").read_text()
    (tmp_path / "again" / "chat_template.jinja").unlink()
    (tmp_path / "again" / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert QwenOmniModel.from_pretrained(tmp_path / "again", **OPTIONS).config == policy.model.config


def test_behaviour_log_probs_equal_the_recompute_and_the_thinkers_own_forward(model_dir: Path) -> None:
    policy, _ = build_policy(model_config(model_dir))
    model = policy.model
    asked = asked_pair()
    video, audio = model.clip_tensors(asked)
    questions = model.tokenize([q.text for q in asked])
    prompted = model.prompt(video, audio, questions)
    assert prompted.positions.shape == (3, 2, prompted.embeds.shape[1])
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    with torch.no_grad():
        out = sample_answers(
            model.lm, prompted.embeds, prompted.mask, model.eos_id, model.pad_id, 8, 1.0,
            generators=gens, min_new_tokens=2, **model.sampling_options(prompted),
        )  # fmt: skip
        recomputed = model.answer_log_probs(prompted, out.tokens, out.mask, 1.0, 2)
    gap = float(((recomputed - out.log_probs).abs() * out.mask).max())
    assert gap < 1e-4, gap
    # recomputed from the tokens: an answer fills a prefix of its row (pad after it) and ends at its
    # first end token, never before min_new_tokens=2; one with no end token is cut at 8, truncated
    for t, m, cut in zip(out.tokens, out.mask, out.truncated, strict=True):
        n = int(m.sum())
        ends = (t[:n] == model.eos_id).nonzero().flatten().tolist()
        assert m[:n].all() and not m[n:].any() and (t[n:] == model.pad_id).all(), (t, m)
        assert bool(cut) == (not ends) and (n == 8 if cut else ends == [n - 1] and n > 2), (t, m, cut)
    assert not torch.isin(out.tokens[out.mask], model.suppressed).any()  # no placeholder sampled
    # the thinker's own path: token ids and processor tensors, its own 3D positions
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


def test_lora_goes_into_the_language_model_only(model_dir: Path) -> None:
    policy = build_nft_policy(
        ModelConfig(family="qwen2_5_omni", pretrained=str(model_dir), options=dict(OPTIONS), lora_rank=2)
    )
    adapted = [n for n, m in policy.transformer.named_modules() if hasattr(m, "lora_A")]
    assert len(adapted) == 2 * 7
    assert all(n.startswith("thinker.model.language_model.layers.") for n in adapted), adapted
    lora = [n for n, _ in policy.transformer.named_parameters() if "lora_" in n]
    assert lora and not any("audio_tower" in n or "visual" in n for n in lora)


@pytest.fixture(scope="module")
def moved(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-step run whose adapter moved (the length reward), checkpointed."""
    run = tmp_path_factory.mktemp("qwen_moved") / "run"
    Trainer(
        load_config(None, overrides(model_dir, run, 1, MOVING, "train.eval_at_start_and_end=false"))
    ).fit()
    return run


@pytest.fixture(scope="module")
def trained(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Two colocated steps whose adapter moves (the length reward: answer_exact alone is 0 for a
    random thinker, no advantage, no update), so step 2 samples with what step 1 trained."""
    run = tmp_path_factory.mktemp("qwen_run") / "run"
    summary = Trainer(load_config(None, overrides(model_dir, run, 2, MOVING))).fit()
    return run, summary


def test_gspo_trains_colocated_on_the_question_file(trained: tuple[Path, dict]) -> None:
    run, summary = trained
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["grad_norm"] > 0 and trained_adapter_norm(run) > 0  # step 1's update moved the adapter
    # on policy at step 2 too: its answers were sampled with step 1's weights (stale ones: gap > 0.1)
    assert all(r["gspo/logp_gap"] < 1e-4 for r in rows), [r["gspo/logp_gap"] for r in rows]
    assert all(abs(r["gspo/ratio_mean"] - 1) < 1e-4 for r in rows)
    assert all(0 < r["answers/mean_tokens"] <= 4 for r in rows)
    assert any(r["answers/mean_tokens"] < 4 for r in rows)  # some answers end before the limit
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
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=1e-5, abs=1e-9)
    assert a[-1]["reward/mean"] == pytest.approx(b[-1]["reward/mean"], abs=1e-6)


def test_a_checkpoint_of_another_tokenizer_or_processor_is_refused(
    model_dir: Path, moved: Path, tmp_path: Path
) -> None:
    from omni_diffusion_rl.inference import load_policy

    run = moved
    other = save_tiny_qwen_omni(tmp_path / "other", extra_words=("zebra",))
    trainer = Trainer(load_config(None, overrides(other, tmp_path / "again", 2)))
    with pytest.raises(CheckpointError, match="another model configuration"):
        trainer.load(run / "checkpoints")
    assert load_policy(run / "checkpoints").model.config["vocabulary"]  # loads with its own base
    # the checkpoint's base folder, its tokenizer swapped for another one of the same size
    swapped = tmp_path / "swapped"
    shutil.copytree(model_dir, swapped)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(other / name, swapped / name)
    assert len(build_tokenizer_of(swapped)) == len(build_tokenizer_of(model_dir))  # same size, other ids
    third = Trainer(load_config(None, overrides(swapped, tmp_path / "third", 2)))
    with pytest.raises(CheckpointError, match="another model configuration"):
        third.load(run / "checkpoints")
    # ... and another processor: the image processor's normalisation changed
    import json

    reprocessed = tmp_path / "reprocessed"
    shutil.copytree(model_dir, reprocessed)
    settings = json.loads((reprocessed / "preprocessor_config.json").read_text())
    (reprocessed / "preprocessor_config.json").write_text(json.dumps({**settings, "image_mean": [0.5] * 3}))
    fourth = Trainer(load_config(None, overrides(reprocessed, tmp_path / "fourth", 2)))
    with pytest.raises(CheckpointError, match="another model configuration"):
        fourth.load(run / "checkpoints")


def build_tokenizer_of(path: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_peft_export_loads_onto_the_bare_thinker(moved: Path, model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from omni_diffusion_rl.export import export_adapter
    from omni_diffusion_rl.inference import load_policy

    run = moved
    out = export_adapter(run / "checkpoints", tmp_path / "export", "peft")
    loaded = load_policy(run / "checkpoints")
    base = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    ids = torch.tensor([[5, 20, 40, 60, 80, 100, 2]])
    with torch.no_grad():
        ours = loaded.model.thinker(input_ids=ids).logits
        theirs = peft_model(input_ids=ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=ids).logits
    assert (ours - plain).abs().max() > 1e-6  # the adapter moved the model
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


def test_a_bf16_base_trains_on_policy(model_dir: Path, tmp_path: Path) -> None:
    """model.base_dtype=bf16 (a real thinker's weights) with bf16 mixed precision: the audio features
    are made in fp32 and cast, sampling and the recompute agree."""
    extra = ("model.base_dtype=bf16", "train.mixed_precision=bf16", "train.eval_at_start_and_end=false")
    run = tmp_path / "run"
    Trainer(load_config(None, overrides(model_dir, run, 1, MOVING, *extra))).fit()
    (row,) = step_records(run)
    assert row["gspo/logp_gap"] < 1e-2 and row["grad_norm"] > 0, row


def test_a_whole_qwen_omni_folder_gives_its_thinker(model_dir: Path, tmp_path: Path) -> None:
    """Qwen's own folders hold the whole model (config.json of model_type qwen2_5_omni with a
    thinker_config, weights under `thinker.`; talker and token2wav besides): the thinker alone loads."""
    import json

    from safetensors.torch import load_file, save_file

    whole = tmp_path / "Qwen2.5-Omni"
    shutil.copytree(model_dir, whole)
    thinker = json.loads((whole / "config.json").read_text())
    config = {"model_type": "qwen2_5_omni", "thinker_config": thinker, "enable_audio_output": True}
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


@pytest.mark.slow  # starts launcher processes
@pytest.mark.parametrize("mode", ["separate", "hybrid"])
def test_gspo_on_the_thinker_runs_in_the_async_modes(model_dir: Path, tmp_path: Path, mode: str) -> None:
    """A rollout process answers with the thinker from its own copy of the files; the answers, their
    clips and behaviour log-probs reach the trainer through the replay buffer; every answer made is
    trained. The adapter moves (the length reward, registered in the launched processes as a
    plug-in: this module) and no answer may lag (max_staleness=0), so every step is on policy only
    if the weight syncs reached the rollout process."""
    from .helpers import REPO, last_json_line
    from .test_separate import _launch

    run = tmp_path / "run"
    args = [
        *overrides(model_dir, run, 3, "train.eval_at_start_and_end=false", MOVING),
        "reward.plugins=[tests.test_qwen_omni]",
        f"execution.mode={mode}",
        "execution.data_timeout_s=60",
        "execution.max_staleness=0",
    ]
    proc = _launch(args, 29679 if mode == "separate" else 29681, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    execution = last_json_line(proc.stdout)["execution"]
    buffer = execution["buffer"]
    assert buffer["trained"] == 3 * 2 * 4 and buffer["staleness_histogram"] == {"0": 3 * 2 * 4}, buffer
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0 < r["answers/mean_tokens"] <= 4 for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows) and trained_adapter_norm(run) > 0  # the adapter moved
    # groups hybrid's trainer made itself (lent, trained from step 2 on) use its own weights: the
    # rollout process's answers must be among steps 2-3's for their gap to say the syncs arrived
    assert execution.get("hybrid", {}).get("lent_groups_trained", 0) < 2 * 2, execution.get("hybrid")
    assert all(r["gspo/logp_gap"] < 1e-4 for r in rows), [r["gspo/logp_gap"] for r in rows]


def test_held_out_answers_in_small_batches_equal_one_batch(model_dir: Path) -> None:
    """A real model answers held-out questions `answer_batch` at a time (memory); the answers are
    those of one batch (each row keyed by its position, left padding masked)."""
    from omni_diffusion_rl.evaluation.avqa import answer_questions
    from omni_diffusion_rl.prompts import load_prompts

    model = build_policy(model_config(model_dir))[0].model
    prompts = load_prompts(str(QUESTIONS), "heldout", model.clip_format)[:6]
    model.answer_batch = 2
    small = answer_questions(model, prompts, 0, greedy=False, max_new_tokens=4)[0]
    model.answer_batch = None
    whole = answer_questions(model, prompts, 0, greedy=False, max_new_tokens=4)[0]
    assert small == whole and len(small) == 6


def test_the_length_check_counts_positions_not_tokens(model_dir: Path) -> None:
    """Qwen's video time positions can run ahead of the prompt's tokens: the check at start counts
    the next position after the longest prompt."""
    model = build_policy(model_config(model_dir))[0].model
    question = model.tokenize(["what colour is the shape ? options : red green blue yellow purple cyan"])[0]
    tokens = model.media_tokens + len(question)
    assert model.prompt_length(question) >= tokens
    video = torch.zeros(1, 4, 3, 28, 28)
    prompted = model.prompt(video, torch.zeros(1, 1, 4000), [question])
    assert model.prompt_length(question) == math.ceil(float(prompted.next_positions.max()))
