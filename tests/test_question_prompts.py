"""What an answering model is shown for a question file's line, and what `--check` finds before a run:
multiple-choice options rendered into the prompt (data.choice_format), both answer forms graded, a
file mixing question kinds training with either answer reward, lines the rewards cannot grade
refused by --check, and the skip report counted by kind, each line under its own split."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.answer_data.question_file import load_question_file
from omni_diffusion_rl.answer_data.questions import FileQuestion
from omni_diffusion_rl.answer_data.style import QuestionStyle
from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.experience.text_rollout import ask
from omni_diffusion_rl.world.avqa_files import QUESTION_FILE, example_clips
from omni_diffusion_rl.world.tiny_clip import DURATION_S, FPS, SAMPLE_RATE

from .helpers import REPO
from .test_question_files import GOOD, TINY, _clip_files, _file_gspo, _write

SHIPPED = REPO / "recipes" / "data" / "tiny_avqa_files" / QUESTION_FILE
LETTERED = QuestionStyle("{question}\n{options}\nAnswer with the letter.", "{letter}. {text}", "\n")


def _mixed_file(folder: Path) -> Path:
    _clip_files(folder)
    choice = GOOD | {"question": "which shape ?", "choices": ["circle", "square"], "answer": "A"}
    return _write(folder, GOOD, choice, choice | {"answer": "square", "split": "heldout"})


def test_a_multiple_choice_line_shows_its_options_in_the_configured_format(tmp_path: Path) -> None:
    keys = load_question_file(_mixed_file(tmp_path), "train", TINY).keys
    gen = torch.Generator().manual_seed(0)
    plain = [ask(k, gen, TINY).text for k in keys]
    assert plain == ["which shape is shown", "which shape ? options : circle square"]
    lettered = ask(keys[1], gen, TINY, style=LETTERED).text
    assert lettered == "which shape ?\nA. circle\nB. square\nAnswer with the letter."


def test_the_model_reads_the_options_in_its_rollout_tokens(tmp_path: Path) -> None:
    """Through the real experience maker: the question tokens of every answer hold the options."""
    from omni_diffusion_rl.trainers.trainer import Trainer

    trainer = Trainer(load_config(None, _file_gspo(tmp_path / "run", 1)))
    maker = trainer.experience
    prompts = [k for k in maker.prompts if FileQuestion.from_key(k).choices][:2]
    rollout = maker.generate(prompts, [0, 1], 1)
    tokenizer = maker.policy.tokenizer
    read = {
        tokenizer.decode(row[m].tolist())
        for row, m in zip(rollout.questions, rollout.question_mask, strict=True)
    }
    for key in prompts:
        question = FileQuestion.from_key(key)
        assert f"{question.question} options : {' '.join(question.choices)}" in read


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.choice_format='{question} {choices}'", "names \\['choices'\\]"),
        ("data.choice_format='{question}'", "must name \\{options\\} exactly once"),
        ("data.option_format='{letter}'", "must name \\{text\\} exactly once"),
        ("data.option_format='{text:>1000000}'", "no conversion or format spec"),
        ("data.option_format='{text.__class__}'", "names \\['text.__class__'\\]"),
        ("data.choice_format='{question} {options} {'", "is not a format string"),
    ],
)
def test_a_bad_choice_format_is_refused_as_the_config_loads(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_check_shows_each_prompt_as_the_model_reads_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from omni_diffusion_rl.cli import main

    monkeypatch.chdir(REPO)
    recipe = ["train", "recipes/configs/tiny_avqa_files_gspo.yaml", f"train.output_dir={tmp_path}"]
    assert main([*recipe, "--check", "--show-prompts", "2"]) == 0
    out = capsys.readouterr().out
    assert "data.prompts: the first 2 of 60 as the model reads them" in out
    assert "[1] what colour is the shape ? options : red green blue yellow purple cyan" in out
    assert "data.eval_prompts: the first 2 of 20" in out
    lettered = ["data.option_format='{letter}) {text}'", "data.option_separator=' | '"]
    assert main([*recipe, *lettered, "--check", "--show-prompts", "1"]) == 0
    assert "options : A) red | B) green | C) blue" in capsys.readouterr().out
    assert main([*recipe, "--show-prompts", "1"]) == 2
    assert "--show-prompts prints what --check reads: give both" in capsys.readouterr().err


def test_a_file_mixing_open_and_multiple_choice_lines_trains_with_choice_letter(tmp_path: Path) -> None:
    """The shipped set holds open lines (describe) beside multiple-choice ones; with choice_letter in
    the weights no sample fails to be scored, and the reward moves the adapter."""
    from omni_diffusion_rl.trainers.trainer import Trainer

    from .helpers import step_records

    run = tmp_path / "run"
    weights = "reward.weights={answer_exact: 1.0, choice_letter: 1.0}"
    overrides = _file_gspo(run, 2, weights, "train.eval_at_start_and_end=false")
    summary = Trainer(load_config(None, overrides)).fit()
    assert summary["samples"]["dropped/reward_failed"] == 0
    assert summary["samples"]["trained"] == 16
    assert any(r["grad_norm"] > 0 for r in step_records(run))  # a right answer moved the adapter


def test_check_refuses_lines_the_rewards_cannot_grade(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rubric line under answer_exact fails its samples at every step: --check says so first."""
    from omni_diffusion_rl.cli import main

    _clip_files(tmp_path)
    rubric = GOOD | {"rubric": "names the shape"}
    del rubric["answer"]
    path = _write(
        tmp_path, GOOD, GOOD | {"question": "which shape now"}, rubric, rubric | {"question": "and now"}
    )
    monkeypatch.chdir(REPO)
    recipe = ["train", "recipes/configs/tiny_avqa_files_gspo.yaml", f"train.output_dir={tmp_path / 'run'}"]
    files = [f"data.prompts={path}", "data.prompts_per_step=2", f"data.eval_prompts={SHIPPED}"]
    assert main([*recipe, *files, "--check"]) == 1
    out = capsys.readouterr().out
    assert "WRONG" in out and "reward.weights.answer_exact" in out
    assert "data.prompts: 2 of 4 prompts cannot be graded by answer_exact: 2x a rubric line" in out


def test_the_skip_report_counts_every_reason_by_kind_and_each_line_under_its_split(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _clip_files(tmp_path)
    missing = [GOOD | {"video": f"gone_{i}.mp4"} for i in range(9)]
    others = [GOOD | {"lable": str(i)} for i in range(3)] + ['{"question": ', GOOD | {"answer": "?!"}]
    heldout_bad = GOOD | {"video": "elsewhere.mp4", "split": "heldout"}
    kinds = [*missing, *others, GOOD | {"split": "heldout"}, heldout_bad]
    path = _write(
        tmp_path, GOOD, *kinds, *[GOOD | {"answer": "x" * 10, "question": f"q{i}"} for i in range(2)]
    )
    with caplog.at_level(logging.WARNING):
        train = load_question_file(path, "train", TINY)
    summary = train.summary()
    assert "14 lines skipped" in summary
    assert "9x " in summary and "gone_0.mp4 does not exist (lines 2, 3, 4, 5, 6, 7, 8, 9, ...)" in summary
    assert "3x unknown fields ['lable']" in summary
    assert "1x " in summary and "is not valid JSON" in summary and "has no letter or digit" in summary
    assert " more" not in summary  # nothing hidden behind "and N more"
    assert "elsewhere.mp4" not in summary  # a held-out line's fault is the held-out split's
    heldout = load_question_file(path, "heldout", TINY)
    assert len(heldout.keys) == 1 and [why for _, why in heldout.skipped] == [
        f"{(tmp_path / 'elsewhere.mp4').resolve()} does not exist"
    ]


def test_the_files_recipe_reads_what_it_read_before_choices_were_rendered() -> None:
    """The shipped set's lines hold the bare question; rendered in the default style they read as
    tiny AVQA's own questions, which the tiny omni base was trained on."""
    from omni_diffusion_rl.world.avqa import Question

    lines = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
    clips = {c.name: c for c in example_clips(12, 4)}
    for line in lines:
        clip = clips[Path(line["video"]).stem]
        shown = QuestionStyle().text(line["question"], tuple(line.get("choices", ())))
        assert shown == Question(clip.scene, line["category"]).text
    assert (FPS, SAMPLE_RATE, DURATION_S) == (TINY.fps, TINY.sample_rate, TINY.seconds)


def test_check_refuses_a_clip_format_the_model_does_not_read(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The refusal a run makes once its model has loaded, made by --check from the model's settings:
    the tiny omni model's constants, and a Qwen folder's preprocessor_config.json and model.options."""
    from omni_diffusion_rl.cli import main

    from .qwen_omni_tiny import save_tiny_qwen_omni

    monkeypatch.chdir(REPO)
    recipe = ["train", "recipes/configs/tiny_avqa_files_gspo.yaml", f"train.output_dir={tmp_path / 'run'}"]
    assert main([*recipe, "data.clip_fps=4", "--check"]) == 1
    assert "WRONG    data.clip_*" in capsys.readouterr().out
    qwen = save_tiny_qwen_omni(tmp_path / "qwen")  # reads 8 kHz sound (its feature extractor)
    as_qwen = [
        "model.family=qwen2_5_omni",
        f"model.pretrained={qwen}",
        "model.options={fps: 6.0, seconds: 0.5, frame_size: 28}",
    ]
    assert main([*recipe, *as_qwen, "--check"]) == 1
    out = capsys.readouterr().out
    assert "data.clip_fps=8, clip_sample_rate=8000" in out and "reads clips at 6 fps, 8000 Hz" in out
    assert main([*recipe, *as_qwen, "model.options={fps: 8.0, seconds: 0.5, frame_size: 28}", "--check"]) == 0


def test_a_rollout_backend_that_cannot_sample_the_family_is_refused_as_the_config_loads() -> None:
    qwen = ["model.family=qwen2_5_omni", "algorithm.name=gspo", "algorithm.rollout_backend=vllm"]
    for family in ("qwen2_5_omni", "qwen3_omni"):
        with pytest.raises(
            ConfigError, match=f"vllm cannot sample model.family={family}.*rollout_backend=hf"
        ):
            load_config(None, [*qwen, f"model.family={family}"])


def test_a_video_line_reads_the_mp4s_own_sound_track_and_one_without_is_skipped(tmp_path: Path) -> None:
    """data.audio_from_video=auto: a line naming only an MP4 hears its AAC track (here a non-square
    clip); an MP4 without a track is a counted skip that says what to do, not silence; never: silence."""
    from omni_diffusion_rl.media import save_mp4
    from omni_diffusion_rl.prompts import split_prompts

    clip = example_clips(1, 0)[0]
    frames = clip.video[..., 2:14, :]  # 12 x 16
    save_mp4(tmp_path / "with.mp4", frames, FPS, clip.wave, SAMPLE_RATE, scale=3)
    save_mp4(tmp_path / "mute.mp4", frames, FPS, scale=3)
    line = {"question": "which shape is shown", "answer": "circle"}
    path = _write(tmp_path, line | {"video": "with.mp4"}, line | {"video": "mute.mp4"})
    report = load_question_file(path, "train", TINY)
    (key,) = report.keys
    question = FileQuestion.from_key(key)
    assert question.audio == question.video and question.video.endswith("with.mp4")
    assert [n for n, _ in report.skipped] == [2]
    assert "mute.mp4 has no sound track" in report.skipped[0][1]
    assert "data.audio_from_video=never" in report.skipped[0][1]
    heard = question.asked(TINY).audio
    assert heard.shape == clip.wave.shape
    halves = [w.reshape(1, 2, -1).pow(2).mean(-1) for w in (heard, clip.wave)]
    louder = [int(h[0, 1] > h[0, 0]) for h in halves]
    assert louder[0] == louder[1]  # the tone where the clip has it (start or end)
    assert halves[0].sum() > 0.5 * halves[1].sum()  # through AAC at 48 kHz and back to 8 kHz
    overrides = [f"data.prompts={path}", "data.audio_from_video=never"]
    silent = [FileQuestion.from_key(k) for k in split_prompts(load_config(None, overrides).data, "train")]
    assert [q.audio for q in silent] == [None, None]


def test_a_system_prompt_opens_every_qwen_prompt_and_the_trainer_reads_the_same(tmp_path: Path) -> None:
    """data.system_prompt is the system turn of every rollout prompt and of the trainer's recomputed
    log-probs (their gap stays at rounding); the tiny omni model, with no template, refuses it."""
    from omni_diffusion_rl.trainers.trainer import Trainer

    from .helpers import step_records
    from .qwen_omni_tiny import save_tiny_qwen_omni
    from .test_qwen_omni import MOVING, overrides

    model_dir = save_tiny_qwen_omni(tmp_path / "qwen")
    run = tmp_path / "run"
    said = "You answer with one word."
    config = load_config(None, overrides(model_dir, run, 1, MOVING, f"data.system_prompt='{said}'"))
    trainer = Trainer(config)
    model = trainer.policy.model
    head = model.tokenizer.decode(model._prompt_ids([], 1, 1))  # noqa: SLF001 - the rendered layout
    assert head.startswith(f"<|im_start|>system\n{said}<|im_end|>") and "helpful assistant" not in head
    trainer.fit()
    (row,) = step_records(run)
    assert row["gspo/logp_gap"] < 1e-4, row
    plain = Trainer(load_config(None, overrides(model_dir, tmp_path / "plain", 1, MOVING))).policy.model
    assert "You are a helpful assistant." in plain.tokenizer.decode(plain._prompt_ids([], 1, 1))  # noqa: SLF001
    with pytest.raises(ConfigError, match="tiny omni model has no chat template"):
        load_config(None, _file_gspo(tmp_path / "tiny", 1, "data.system_prompt=hello"))


def test_the_example_set_is_written_at_qwens_clip_format_with_its_sound_in_the_mp4s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """odrl avqa-files --fps 2 --seconds 4 --sample-rate 16000 --size 84x56 --sound-in-mp4: the same
    scenes, every line usable at that format, the picture non-square, the tone in its half."""
    from omni_diffusion_rl.answer_data.clip_files import ClipFormat
    from omni_diffusion_rl.cli import main

    args = ["avqa-files", "--output", str(tmp_path / "set"), "--train-clips", "2", "--heldout-clips", "1"]
    qwen = ["--fps", "2", "--seconds", "4", "--sample-rate", "16000", "--size", "84x56", "--sound-in-mp4"]
    assert main([*args, *qwen]) == 0
    path = tmp_path / "set" / QUESTION_FILE
    clip = ClipFormat(2.0, 16000, 4.0)
    train = load_question_file(path, "train", clip)
    assert len(train.keys) == 2 * 5 and not train.skipped
    question = FileQuestion.from_key(train.keys[0])
    assert question.audio == question.video  # the MP4's own track
    asked = question.asked(clip)
    assert asked.video.shape == (8, 3, 56, 84) and asked.audio.shape == (1, 64000)
    (scene_clip,) = example_clips(1, 0)
    early = scene_clip.scene.when == "early"
    energy = asked.audio.reshape(2, -1).pow(2).mean(-1)
    assert (energy[0] > energy[1]) == early  # the tone in the half the scene has it
    assert main([*args, "--size", "84", "--overwrite"]) == 2
    assert "give WIDTHxHEIGHT" in capsys.readouterr().err
    assert main([*args, "--fps", "2.5", "--overwrite"]) == 2


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_qwen_gradient_checkpointing_recomputes_the_decoder_and_leaves_the_step_unchanged(
    tmp_path: Path, family: str
) -> None:
    """model.gradient_checkpointing=true on the Qwen families: the language model's layers run
    through the checkpoint in the trainer's recompute (also after an evaluation's eval()), and two
    steps give the same losses and adapter within 1e-5."""
    from omni_diffusion_rl.trainers.trainer import Trainer

    from .helpers import step_records
    from .test_qwen_omni import MOVING, overrides

    model_dir = _tiny_qwen(family, tmp_path / "model")
    runs = {}
    for name, extra in (("plain", []), ("ckpt", ["model.gradient_checkpointing=true"])):
        config = overrides(model_dir, tmp_path / name, 2, MOVING, f"model.family={family}", *extra)
        trainer = Trainer(load_config(None, config))
        layers = trainer.policy.model._decoder_layers()  # noqa: SLF001
        calls: list[int] = []
        if extra:
            recompute = layers[0]._gradient_checkpointing_func  # noqa: SLF001

            def counting(*args, _recompute=recompute, _calls=calls, **kwargs):  # noqa: ANN002, ANN003, ANN202
                _calls.append(1)
                return _recompute(*args, **kwargs)

            for layer in layers:
                layer._gradient_checkpointing_func = counting  # noqa: SLF001
        trainer.fit()
        runs[name] = (trainer, step_records(tmp_path / name), len(calls))
    assert runs["ckpt"][2] >= 2 * len(layers), "each step's recompute ran the layers through the checkpoint"
    assert runs["plain"][2] == 0
    for a, b in zip(runs["plain"][1], runs["ckpt"][1], strict=True):
        assert a["loss/total"] == pytest.approx(b["loss/total"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] > 0
    for p, q in zip(runs["plain"][0].params, runs["ckpt"][0].params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_qwen_sound_features_padded_to_the_clip_are_the_processors_where_the_towers_read(
    tmp_path: Path,
) -> None:
    """Features padded to the longest clip (not the extractor's chunk_length) hold the frames the
    processor's max-length call makes, bit for bit, where the mask keeps them; the audio tower's output
    is the same; and the padded width is the clip's, not the chunk's."""
    from omni_diffusion_rl.models.qwen_omni import QwenOmniModel

    from .qwen_omni_tiny import save_tiny_qwen_omni

    model = QwenOmniModel.from_pretrained(
        save_tiny_qwen_omni(tmp_path / "m"), fps=8.0, seconds=0.5, frame_size=28
    )
    fe = model.feature_extractor
    fe.chunk_length, fe.n_samples, fe.nb_max_frames = (
        4,
        4 * fe.sampling_rate,
        4 * fe.sampling_rate // fe.hop_length,
    )
    waves = torch.randn(3, 1, 4000, generator=torch.Generator().manual_seed(0)) * 0.2
    ours = model._audio_inputs(waves)  # noqa: SLF001
    theirs = fe(
        [w.mean(0).numpy() for w in waves],
        sampling_rate=fe.sampling_rate,
        return_attention_mask=True,
        padding="max_length",
        truncation=True,
        return_tensors="pt",
    )
    assert torch.equal(ours["feature_attention_mask"].sum(1), theirs["attention_mask"].sum(1))
    kept = int(ours["feature_attention_mask"].sum(1).max())
    assert ours["input_features"].shape[-1] == kept < theirs["input_features"].shape[-1] // 4
    assert torch.equal(ours["input_features"], theirs["input_features"][..., :kept])
    tower = model.thinker.model.get_audio_features
    with torch.no_grad():
        a = tower(ours["input_features"], ours["feature_attention_mask"], return_dict=True).last_hidden_state
        b = tower(theirs["input_features"], theirs["attention_mask"], return_dict=True).last_hidden_state
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_a_rollout_runs_the_towers_once_per_clip_and_answers_as_before(tmp_path: Path, family: str) -> None:
    """A group's k answers share one pass of the audio and vision towers (not k), in the rollout and
    in the trainer's recompute, and the sampler's log-probs still equal the recompute's."""
    from omni_diffusion_rl.trainers.trainer import Trainer

    from .helpers import step_records
    from .test_qwen_omni import MOVING, overrides

    run = tmp_path / "run"
    config = overrides(_tiny_qwen(family, tmp_path / "m"), run, 1, MOVING, f"model.family={family}")
    trainer = Trainer(load_config(None, [*config, "train.eval_at_start_and_end=false"]))
    inner = trainer.policy.model.thinker.model
    seen: dict[str, list[int]] = {"audio": [], "video": []}
    for kind in seen:
        tower = getattr(inner, f"get_{kind}_features")

        def counted(features, *args, _tower=tower, _seen=seen[kind], _kind=kind, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            grid = args[0] if args else kwargs.get("video_grid_thw")
            _seen.append(len(features) if _kind == "audio" else len(grid))
            return _tower(features, *args, **kwargs)

        setattr(inner, f"get_{kind}_features", counted)
    maker = trainer.experience
    rollout = maker.generate(maker.prompts[:2], [0, 1], 1)
    assert seen == {"audio": [2], "video": [2]}  # 2 clips, 4 answers each
    # the rollout keeps the bytes the image processor reads: a quarter of float32, the same prompt
    model = trainer.policy.model
    assert rollout.video.dtype == torch.uint8
    floats = rollout.video.float() / 255
    ids = rollout.question_ids()
    with torch.no_grad():
        a, b = model.prompt(rollout.video, rollout.audio, ids), model.prompt(floats, rollout.audio, ids)
    assert torch.equal(a.embeds, b.embeds)
    seen["audio"].clear()
    trainer.fit()  # a step: its rollout, then the trainer's recompute, each once per clip
    assert seen["audio"] == [2, 2], seen
    assert step_records(run)[0]["gspo/logp_gap"] < 1e-4


def test_the_qwen_head_runs_only_where_log_probs_are_read(tmp_path: Path) -> None:
    """Full-vocabulary logits at the prompt's last position when sampling and at the answer's
    positions in the recompute, never over the whole prompt (hundreds of media positions)."""
    from omni_diffusion_rl.trainers.trainer import Trainer

    from .helpers import step_records
    from .qwen_omni_tiny import save_tiny_qwen_omni
    from .test_qwen_omni import MOVING, overrides

    run = tmp_path / "run"
    config = overrides(
        save_tiny_qwen_omni(tmp_path / "m"), run, 1, MOVING, "train.eval_at_start_and_end=false"
    )
    trainer = Trainer(load_config(None, config))
    model = trainer.policy.model
    widths: list[int] = []
    model.thinker.lm_head.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[1]))
    trainer.fit()
    limit = trainer.cfg.algorithm.max_new_tokens
    assert step_records(run)[0]["grad_norm"] > 0  # the recompute ran, and trained
    assert widths[0] == 1  # the sampler's first call: the prompt's last position
    assert max(widths) <= limit + 1 < model.media_tokens, (widths, model.media_tokens)


@pytest.mark.parametrize("folder_settings", [True, False])
def test_the_frame_size_qwens_processor_reads_is_computed_as_it_resizes(
    tmp_path: Path, folder_settings: bool
) -> None:
    """processor_frame_size gives the size Qwen's image processor resizes a frame to (its patch grid
    times the patch), for non-square frames, at the tiny folder's settings and at the processor's own
    defaults (Qwen's 56 x 56 to 28 x 28 x 1280 pixels)."""
    import numpy as np
    from transformers import Qwen2VLImageProcessorPil

    from omni_diffusion_rl.models.qwen_omni import processor_frame_size

    from .qwen_omni_tiny import save_tiny_qwen_omni

    if folder_settings:
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(save_tiny_qwen_omni(tmp_path / "m")))
    else:
        processor = Qwen2VLImageProcessorPil()
    patch = int(processor.patch_size)
    for height, width in [(30, 40), (56, 84), (120, 90), (300, 500), (480, 854), (1080, 1920), (20, 300)]:
        frame = np.zeros((height, width, 3), np.uint8)
        grid = processor(images=[frame], return_tensors="np")["image_grid_thw"][0]
        expected = (grid[1] * patch, grid[2] * patch)
        assert processor_frame_size(height, width, processor) == expected, (height, width)


def test_a_non_square_frame_size_keeps_the_clips_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.options.frame_size "WIDTHxHEIGHT": frames resized to it (not squashed to a square), the
    prompt holds the processor's token count for that size, and --check names the size Qwen's own
    processor reads the user's clips at when the model's differs."""
    from omni_diffusion_rl.answer_data.questions import AskedQuestion
    from omni_diffusion_rl.cli import main
    from omni_diffusion_rl.models.qwen_omni import QwenOmniModel

    from .qwen_omni_tiny import save_tiny_qwen_omni

    folder = save_tiny_qwen_omni(tmp_path / "m")
    model = QwenOmniModel.from_pretrained(folder, fps=8.0, seconds=0.5, frame_size="56x28")
    clip = model.clip_format
    assert clip.frame_size == (28, 56)
    frames = torch.rand(clip.frames, 3, 30, 60)
    video, audio = model.clip_tensors([AskedQuestion("q", None, "all", video=frames)])
    assert video.shape[-2:] == (28, 56)
    with torch.no_grad():
        prompted = model.prompt(video, audio, model.tokenize(["which colour ?"]))
    grid = model._video_inputs(video)["video_grid_thw"][0].tolist()  # noqa: SLF001
    assert grid[1:] == [2, 4] and prompted.embeds.shape[0] == 1
    with pytest.raises(ValueError, match="WIDTHxHEIGHT"):
        QwenOmniModel.from_pretrained(folder, fps=8.0, seconds=0.5, frame_size="wide")
    _clip_files(tmp_path)
    path = _write(tmp_path, GOOD, GOOD | {"question": "which shape now"})
    monkeypatch.chdir(REPO)
    recipe = ["train", "recipes/configs/tiny_qwen_own_clips.yaml", f"model.pretrained={folder}"]
    args = [*recipe, f"data.prompts={path}", f"data.eval_prompts={SHIPPED}", "data.prompts_per_step=2"]
    square = "model.options={fps: 8.0, seconds: 0.5, frame_size: 56}"
    assert main([*args, square, f"train.output_dir={tmp_path / 'run'}", "--check"]) == 0
    out = capsys.readouterr().out
    assert "ok.mp4 is 16x16; the model reads frames at 56x56, Qwen's own processor at 28x28" in out


def test_selected_qwen3_prompts_equal_prompts_built_from_the_selected_clips(tmp_path: Path) -> None:
    """QwenPrompted.rows (and repeated) against building the prompts from the re-ordered, repeated
    clips directly: embeddings, positions, the video mask and every deepstack level (rows only at the
    video positions, in batch order) alike, so a selection error cannot hide behind both paths."""
    from omni_diffusion_rl.models.qwen_omni import Qwen3OmniModel

    from .qwen3_omni_tiny import save_tiny_qwen3_omni

    model = Qwen3OmniModel.from_pretrained(
        save_tiny_qwen3_omni(tmp_path / "m"), fps=8.0, seconds=0.5, frame_size=32
    )
    clip = model.clip_format
    gen = torch.Generator().manual_seed(0)
    video = torch.rand(2, clip.frames, 3, 32, 32, generator=gen)
    audio = torch.randn(2, 1, clip.samples, generator=gen) * 0.1
    ids = model.tokenize(["which colour ?", "which shape is shown here ?"])
    index = torch.tensor([1, 0, 1])
    with torch.no_grad():
        picked = model.prompt(video, audio, ids).rows(index)
        direct = model.prompt(video[index], audio[index], [ids[i] for i in index.tolist()])
    assert picked.deepstack and len(picked.deepstack) == len(direct.deepstack)
    for a, b in zip(
        (picked.embeds, picked.positions, picked.mask, picked.visual_mask),
        (direct.embeds, direct.positions, direct.mask, direct.visual_mask),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    for a, b in zip(picked.deepstack, direct.deepstack, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _tiny_qwen(family: str, path: Path) -> Path:
    """A tiny random-init thinker of `family` saved in `path`."""
    from .qwen3_omni_tiny import save_tiny_qwen3_omni
    from .qwen_omni_tiny import save_tiny_qwen_omni

    return (save_tiny_qwen3_omni if family == "qwen3_omni" else save_tiny_qwen_omni)(path)
