"""A user's questions about their own clips (answer_data/): the JSONL format, media decoded by PyAV and
soundfile, every bad line counted and skipped with its reason, the shipped example set decoded back
within the codecs' tolerance, the answer rewards (also served), and GSPO training on the files."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from omni_diffusion_rl.answer_data.clip_files import (
    AUDIO_TOLERANCE,
    VIDEO_TOLERANCE,
    ClipFormat,
    decode_audio,
    decode_video,
    write_mp4,
    write_wav,
)
from omni_diffusion_rl.answer_data.question_file import QuestionFileError, load_question_file
from omni_diffusion_rl.answer_data.questions import AskedQuestion, FileQuestion, chosen_letter, is_right
from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.prompts import PromptFileError, load_prompts
from omni_diffusion_rl.world.avqa_files import QUESTION_FILE, example_clips, write_example_set
from omni_diffusion_rl.world.tiny_clip import DURATION_S, FPS, SAMPLE_RATE

from .helpers import REPO, odrl, step_records

SHIPPED = REPO / "recipes" / "data" / "tiny_avqa_files"
TINY = ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1)


def test_the_shipped_example_set_is_what_the_command_makes_and_decodes_back_within_tolerance(
    tmp_path: Path,
) -> None:
    """Every clip decoded through the user path equals the rendered clip within the stated codec
    tolerance (2/255 a pixel, 2/32768 a sample), and the shipped question file is the command's."""
    made = write_example_set(tmp_path / "set")
    assert made.read_text() == (SHIPPED / QUESTION_FILE).read_text()
    clips = example_clips(12, 4)
    for clip in clips:
        video = decode_video(SHIPPED / "clips" / f"{clip.name}.mp4", TINY)
        audio = decode_audio(SHIPPED / "clips" / f"{clip.name}.wav", TINY)
        assert video.shape == clip.video.shape and audio.shape == clip.wave.shape
        assert (video - clip.video).abs().max() <= VIDEO_TOLERANCE, clip.name
        assert (audio - clip.wave).abs().max() <= AUDIO_TOLERANCE, clip.name
    train = load_prompts(str(SHIPPED / QUESTION_FILE), "train", TINY)
    heldout = load_prompts(str(SHIPPED / QUESTION_FILE), "heldout", TINY)
    assert (len(train), len(heldout)) == (12 * 5, 4 * 5)
    scenes = {FileQuestion.from_key(k).video for k in heldout}
    assert not scenes & {FileQuestion.from_key(k).video for k in train}


def _clip_files(folder: Path) -> None:
    clip = example_clips(1, 0)[0]
    write_mp4(folder / "ok.mp4", clip.video, FPS)
    write_wav(folder / "ok.wav", clip.wave, SAMPLE_RATE)


def _write(folder: Path, *lines: dict | str) -> Path:
    path = folder / "q.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


GOOD = {"video": "ok.mp4", "audio": "ok.wav", "question": "which shape is shown", "answer": "circle"}


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("missing", "does not exist"),
        ("undecodable", "cannot be decoded as video"),
        ("undecodable_audio", "cannot be decoded as sound"),
        ("zero_length", "zero length"),
        ("stereo", "has 2 channels; the run reads 1"),
        ("sample_rate", "is at 16000 Hz; the run reads 8000 Hz"),
        ("too_short", "is too short"),
        ("short_video", "is too short: 1 of the 4 frames"),
        ("outside", "must be relative to the question file's folder"),
        ("not_json", "is not valid JSON"),
        ("nested", "nested 3001 deep"),
        ("backslash_root", "stay inside it"),
        ("link_out", "stay inside it"),
        ("no_video_stream", "has no video stream"),
        ("empty_wav", "has no samples"),
        ("missing_audio", "nowhere.wav does not exist"),
        ("loud_wav", "outside [-1, 1]"),
        ("same_choices", "each must differ"),
        ("letter_choice", "may not be a single letter"),
        ("no_letters", "has no letter or digit"),
        ("long_key", "at most 16384"),
        ("unknown_field", "unknown fields ['lable']"),
        ("no_media", "neither a video nor an audio file"),
        ("no_answer", "neither an answer nor a rubric"),
        ("answer_not_an_option", "neither a letter nor the text of one of the choices"),
    ],
)
def test_each_bad_line_is_skipped_with_its_reason(
    tmp_path: Path, case: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    _clip_files(tmp_path)
    line: dict | str = dict(GOOD)
    if case == "missing":
        line["video"] = "nowhere.mp4"
    elif case == "undecodable":
        (tmp_path / "bad.mp4").write_bytes(b"not a video at all" * 20)
        line["video"] = "bad.mp4"
    elif case == "undecodable_audio":
        (tmp_path / "bad.wav").write_bytes(b"RIFF but no wave" * 20)
        line["audio"] = "bad.wav"
    elif case == "zero_length":
        (tmp_path / "empty.wav").write_bytes(b"")
        line["audio"] = "empty.wav"
    elif case == "stereo":
        soundfile.write(str(tmp_path / "st.wav"), np.zeros((4000, 2), dtype=np.float32), SAMPLE_RATE)
        line["audio"] = "st.wav"
    elif case == "sample_rate":
        soundfile.write(str(tmp_path / "sr.wav"), np.zeros(8000, dtype=np.float32), 16000)
        line["audio"] = "sr.wav"
    elif case == "too_short":
        soundfile.write(str(tmp_path / "short.wav"), np.zeros(100, dtype=np.float32), SAMPLE_RATE)
        line["audio"] = "short.wav"
    elif case == "short_video":
        write_mp4(tmp_path / "still.mp4", example_clips(1, 0)[0].video[:1], FPS)
        line["video"] = "still.mp4"
    elif case == "outside":
        line["video"] = "../ok.mp4"
    elif case == "not_json":
        line = '{"video": "ok.mp4", "question": '
    elif case == "nested":
        line = '{"question": ' + "[" * 3000 + "]" * 3000 + "}"
    elif case == "backslash_root":
        line["video"] = "\\etc\\passwd"
    elif case == "link_out":
        (tmp_path / "sub").mkdir()
        (tmp_path / "sub" / "out.mp4").symlink_to(tmp_path.parent)
        line["video"] = "sub/out.mp4"
    elif case == "no_video_stream":
        line["video"] = "ok.wav"  # sound only
    elif case == "empty_wav":
        soundfile.write(str(tmp_path / "e.wav"), np.zeros(0, dtype=np.float32), SAMPLE_RATE)
        line["audio"] = "e.wav"
    elif case == "missing_audio":
        line["audio"] = "nowhere.wav"
    elif case == "loud_wav":
        soundfile.write(str(tmp_path / "l.wav"), np.full(4000, 1.5, np.float32), SAMPLE_RATE, subtype="FLOAT")
        line["audio"] = "l.wav"
    elif case == "same_choices":
        line |= {"choices": ["Red", "red!"], "answer": "A"}
    elif case == "letter_choice":
        line |= {"choices": ["cat", "a"], "answer": "cat"}
    elif case == "no_letters":
        line["answer"] = "?!"
    elif case == "long_key":
        line |= {"choices": [f"{i} " + "x" * 1900 for i in range(10)], "answer": "A"}
    elif case == "unknown_field":
        line["lable"] = "x"
    elif case == "no_media":
        del line["video"], line["audio"]
    elif case == "no_answer":
        del line["answer"]
    elif case == "answer_not_an_option":
        line |= {"choices": ["red", "blue"], "answer": "green"}
    path = _write(tmp_path, GOOD, line, "# a comment", "")
    with caplog.at_level(logging.WARNING):
        report = load_question_file(path, "train", TINY)
    assert len(report.keys) == 1 and [n for n, _ in report.skipped] == [2]
    assert reason in report.skipped[0][1], report.skipped
    assert reason in caplog.text  # the skipped line is logged with its reason
    with pytest.raises(PromptFileError, match="no usable train question.*1 lines skipped"):
        load_prompts(str(_write(tmp_path, line)), "train", TINY)


def test_a_file_of_only_bad_lines_and_a_missing_split_are_errors(tmp_path: Path) -> None:
    _clip_files(tmp_path)
    path = _write(tmp_path, GOOD | {"video": "a.mp4"}, GOOD | {"video": "b.mp4"})
    with pytest.raises(QuestionFileError, match=r"2 lines skipped: .*a\.mp4 does not exist \(2x\)"):
        load_question_file(path, "train", TINY)
    with pytest.raises(QuestionFileError, match='mark held-out lines with "split": "heldout"'):
        load_question_file(_write(tmp_path, GOOD), "heldout", TINY)
    with pytest.raises(PromptFileError, match="needs the run's clip format"):
        load_prompts(str(path))


def test_a_video_whose_stream_starts_late_and_unicode_answers_are_read_right(tmp_path: Path) -> None:
    import av

    clip = example_clips(1, 0)[0]
    rgb = (clip.video * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    with av.open(str(tmp_path / "late.mp4"), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width = stream.height = 16
        stream.pix_fmt, stream.options = "yuv444p", {"crf": "0"}
        for i, image in enumerate(rgb):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i + 3  # the stream's first frame at 3/8 s
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    video = decode_video(tmp_path / "late.mp4", TINY)
    assert (video - clip.video).abs().max() <= VIDEO_TOLERANCE
    cat = AskedQuestion("which animal", "猫", "all")
    assert is_right("猫", cat) == 1.0 and is_right("狗", cat) == 0.0 and is_right("", cat) == 0.0
    assert is_right("ＣＡＴ", AskedQuestion("q", "cat", "all")) == 1.0  # NFKC: full-width letters


def test_a_valid_line_holding_a_line_separator_stays_one_line(tmp_path: Path) -> None:
    _clip_files(tmp_path)
    path = tmp_path / "q.jsonl"
    path.write_text(
        json.dumps(GOOD | {"question": "which\u2028shape"}, ensure_ascii=False) + "\n" + json.dumps(GOOD)
    )
    report = load_question_file(path, "train", TINY)
    assert len(report.keys) == 2 and not report.skipped


def test_a_line_that_is_not_utf8_is_skipped_alone(tmp_path: Path) -> None:
    """One byte that is not UTF-8 costs its line, not the file (it refused the whole file); a
    byte-order mark is still read."""
    _clip_files(tmp_path)
    path = tmp_path / "q.jsonl"
    good = json.dumps(GOOD).encode()
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n" + good[:-1] + b', "x": "\xff"}\n' + good + b"\n")
    report = load_question_file(path, "train", TINY)
    assert len(report.keys) == 2 and [n for n, _ in report.skipped] == [2], report.skipped
    assert "the line is not UTF-8 text (byte " in report.skipped[0][1], report.skipped


def test_a_media_link_retargeted_after_loading_is_not_followed(tmp_path: Path) -> None:
    """A line's media path is resolved when the file is read: a link inside the folder, retargeted
    later to a clip outside it, still reads the clip it named then."""
    (tmp_path / "set").mkdir()
    inside, outside = example_clips(2, 0)
    write_mp4(tmp_path / "set" / "inside.mp4", inside.video, FPS)
    write_mp4(tmp_path / "outside.mp4", outside.video, FPS)
    (tmp_path / "set" / "clip.mp4").symlink_to(tmp_path / "set" / "inside.mp4")
    path = _write(tmp_path / "set", GOOD | {"video": "clip.mp4", "audio": None})
    (key,) = load_prompts(str(path), "train", TINY, sound_from_video=False)  # a silent MP4
    (tmp_path / "set" / "clip.mp4").unlink()
    (tmp_path / "set" / "clip.mp4").symlink_to(tmp_path / "outside.mp4")
    video = FileQuestion.from_key(key).asked(TINY).video
    assert video is not None and (video - inside.video).abs().max() <= VIDEO_TOLERANCE
    assert (video - outside.video).abs().max() > VIDEO_TOLERANCE


def test_a_text_prompt_file_cannot_smuggle_a_key_and_a_generator_refuses_question_files(
    tmp_path: Path,
) -> None:
    from omni_diffusion_rl.trainers.trainer import Trainer

    (tmp_path / "p.txt").write_text('a red circle\n{"question": "q", "audio": "/etc/x.wav", "answer": "a"}\n')
    with pytest.raises(PromptFileError, match="prompt 2 starts with"):
        load_prompts(str(tmp_path / "p.txt"))
    overrides = [
        f"data.prompts={SHIPPED / QUESTION_FILE}",
        f"train.output_dir={tmp_path / 'run'}",
        "eval.metrics=[]",
    ]
    with pytest.raises(ConfigError, match="question files are for answering models"):
        Trainer(load_config(None, [*overrides, "train.steps=1"]))


def test_a_multiple_choice_answer_is_read_without_guessing() -> None:
    choices = ("red", "blue", "green")
    assert chosen_letter("the answer is a dog", ("cat", "dog")) == "B"  # "a" is an article here
    assert chosen_letter("option A is wrong, the answer is B", choices) == "B"
    assert chosen_letter("dark red", ("red", "dark red")) == "B"
    assert chosen_letter("it is dark red", ("red", "dark red")) == "B"
    assert chosen_letter("red, so the answer is B", choices) is None  # a letter and an option disagree
    assert chosen_letter("B", choices) == "B" and chosen_letter("(c).", choices) == "C"
    assert chosen_letter("The answer is b", choices) == "B" and chosen_letter("option A", choices) == "A"
    assert chosen_letter("it is blue", choices) == "B"
    assert chosen_letter("a square shape", ("circle", "square")) == "B"  # the option's text, not "a"
    assert chosen_letter("red or blue", choices) is None and chosen_letter("d", choices) is None
    assert chosen_letter("x " * 100_000, choices) is None  # linear, however long
    q = AskedQuestion("which colour", "B", "all", choices=choices)
    assert is_right("blue", q) == 1.0 and is_right("b", q) == 1.0 and is_right("red", q) == 0.0


def test_the_answer_rewards_grade_by_the_key_and_refuse_what_they_cannot_grade() -> None:
    from omni_diffusion_rl.registry import rewards

    exact, letter = rewards.get("answer_exact")(), rewards.get("choice_letter")()
    mc = FileQuestion("which colour", audio="/x.wav", answer="blue", choices=("red", "blue")).key()
    open_q = FileQuestion("what barks", audio="/x.wav", answer="a dog").key()
    rubric = FileQuestion("describe it", audio="/x.wav", rubric="mentions the dog").key()
    tiny = "color | a red circle with a low tone at the start"

    def media(*texts: str) -> MediaBatch:
        return MediaBatch(audio=torch.zeros(len(texts), 1, 8), text=list(texts))

    mc_letter = FileQuestion("which colour", audio="/x.wav", answer="B", choices=("red", "blue")).key()
    # exact: the option's text; where the file answers by letter, the letter alone too
    graded = exact.score(
        media("Blue.", "B", "(b)", "blue", "A dog!", "red"), [mc, mc, mc_letter, mc_letter, open_q, tiny]
    )
    assert graded.tolist() == [1, 0, 1, 1, 1, 1]  # "B" for a text answer: its options may lack letters
    assert exact.score(media("the answer is b", "A", "red"), [mc, mc_letter, mc]).tolist() == [0, 0, 0]
    # tiny AVQA lists its options without letters: a bare letter is no answer there
    from omni_diffusion_rl.world.avqa import parse_question

    bare = "abcdef"[parse_question(tiny).choices.index("red")]
    assert exact.score(media(bare, "red"), [tiny, tiny]).tolist() == [0, 1]
    assert letter.score(media("the answer is b", "red"), [mc, mc]).tolist() == [1, 0]
    # a file mixing multiple-choice and open lines: choice_letter grades the open ones exactly
    assert letter.score(media("a dog", "a cat", "it is blue"), [open_q, open_q, mc_letter]).tolist() == [
        1,
        0,
        1,
    ]
    for reward in (exact, letter):
        with pytest.raises(ValueError, match="no answer \\(a rubric line\\)"):
            reward.score(media("x"), [rubric])
    with pytest.raises(ValueError, match="not valid JSON"):
        exact.score(media("x"), ["{oops"])


@pytest.mark.slow
def test_a_served_answer_reward_grades_question_file_keys() -> None:
    """The reward server contract carries the key and the answer text; a served grader (here
    answer_exact, in its own process on loopback) scores them as the local one does."""
    from omni_diffusion_rl.serving.client import RemoteReward
    from omni_diffusion_rl.serving.process import ServerProcess

    from .helpers import ENV

    key = FileQuestion("which colour", audio="/clips/a.wav", answer="blue", choices=("red", "blue")).key()
    with ServerProcess(["answer_exact"], env=ENV, cwd=REPO) as server:
        client = RemoteReward(server.url, "answer_exact")
        scored = client.score(MediaBatch(audio=torch.zeros(3, 1, 8), text=["blue", "B", "red"]), [key] * 3)
        client.close()
    assert scored.scores.tolist() == [1.0, 0.0, 0.0]  # exact: a letter answers only a letter answer


def _file_gspo(run: Path, steps: int, *extra: str) -> list[str]:
    from .test_gspo_loop import gspo_overrides

    questions = str(SHIPPED / QUESTION_FILE)
    return [
        *gspo_overrides("builtin-omni", run, steps),
        f"data.prompts={questions}",
        f"data.eval_prompts={questions}",
        "data.eval_samples=20",
        "reward.weights={answer_exact: 1.0}",
        *extra,
    ]


def test_gspo_trains_on_the_shipped_question_file_and_accounts_for_every_sample(tmp_path: Path) -> None:
    from omni_diffusion_rl.trainers.trainer import Trainer

    run = tmp_path / "run"
    summary = Trainer(load_config(None, _file_gspo(run, 2, "train.checkpoint_every=1"))).fit()
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["gspo/logp_gap"] < 1e-4 for r in rows)
    assert summary["samples"] == {
        "generated": 16,
        "trained": 16,
        "dropped/reward_failed": 0,
        "dropped/group_too_small": 0,
    }
    accuracy = summary["heldout_accuracy_after"]
    assert {"greedy", "greedy/color", "greedy/describe", "sampled/when"} <= set(accuracy)
    assert 0 < accuracy["greedy"] < 1  # the shipped base answers part of the files' questions
    assert set(summary["components_after"]) == {"answer_exact"}


def test_a_clip_format_the_model_does_not_read_is_refused(tmp_path: Path) -> None:
    from omni_diffusion_rl.trainers.trainer import Trainer

    overrides = _file_gspo(tmp_path / "run", 1, "data.clip_fps=4")
    with pytest.raises(ConfigError, match="reads clips at 8 fps, 8000 Hz, 0.5 s"):
        Trainer(load_config(None, overrides))


def test_the_files_recipe_checks_ready_and_names_a_missing_question_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from omni_diffusion_rl.cli import main

    monkeypatch.chdir(REPO)
    recipe = ["train", "recipes/configs/tiny_avqa_files_gspo.yaml", f"train.output_dir={tmp_path}", "--check"]
    assert main(recipe) == 0, capsys.readouterr().out
    assert "questions.jsonl: 60 prompts" in capsys.readouterr().out
    assert main([*recipe, f"data.prompts={tmp_path / 'mine.jsonl'}"]) == 1
    assert "mine.jsonl does not exist" in capsys.readouterr().out


@pytest.mark.slow  # starts launcher processes
def test_gspo_on_the_question_file_runs_separate_with_every_sample_accounted(tmp_path: Path) -> None:
    """The rollout process decodes the files itself; answers and their clips reach the trainer
    through the replay buffer, and every answer made is trained."""
    from .helpers import last_json_line
    from .test_separate import _launch

    run = tmp_path / "run"
    overrides = [
        *_file_gspo(run, 3, "train.eval_at_start_and_end=false"),
        "execution.mode=separate",
        "execution.data_timeout_s=60",
    ]
    proc = _launch(overrides, 29677)
    assert proc.returncode == 0, proc.stderr[-4000:]
    buffer = last_json_line(proc.stdout)["execution"]["buffer"]
    assert buffer["trained"] == 3 * 2 * 4, buffer
    assert [r["step"] for r in step_records(run)] == [1, 2, 3]


def test_a_registered_question_set_is_asked_as_tiny_avqa_is(tmp_path: Path) -> None:
    """data.questions names a registered question set: tiny AVQA is one, a user's is another."""
    import dataclasses

    from omni_diffusion_rl.experience.text_rollout import ask
    from omni_diffusion_rl.registry import RegistryError, question_sets
    from omni_diffusion_rl.trainers.trainer import Trainer
    from omni_diffusion_rl.world.avqa import TRAIN_QUESTIONS, TinyAVQAQuestions

    @question_sets.register("test_in_the_dark", overwrite=True)
    class InTheDark(TinyAVQAQuestions):
        """Tiny AVQA's questions on black frames."""

        def ask(self, prompt: str, gen: torch.Generator) -> AskedQuestion:
            asked = super().ask(prompt, gen)
            return dataclasses.replace(asked, video=torch.zeros_like(asked.video))

    prompt = TRAIN_QUESTIONS[0]
    lit = ask(prompt, torch.Generator().manual_seed(0), TINY)
    dark = ask(prompt, torch.Generator().manual_seed(0), TINY, "test_in_the_dark")
    assert lit.text == dark.text and lit.video.abs().sum() > 0 and dark.video.abs().sum() == 0
    assert torch.equal(lit.audio, dark.audio)
    from .test_gspo_loop import gspo_overrides

    overrides = gspo_overrides("builtin-omni", tmp_path / "run", 1, "data.questions=nowhere")
    with pytest.raises(RegistryError, match="nowhere.*tiny_avqa"):
        Trainer(load_config(None, overrides))


@pytest.mark.slow  # runs `odrl avqa-files` processes
def test_avqa_files_never_overwrites_a_users_questions_without_overwrite(tmp_path: Path) -> None:
    """A folder that already holds questions.jsonl (a user's own, say) is refused with a sentence and
    left as it was; --overwrite replaces it; a folder that cannot be made is a sentence, not a traceback."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "questions.jsonl").write_text("my own questions\n")
    command = [*odrl("avqa-files"), "--train-clips", "1"]
    command += ["--heldout-clips", "1"]
    refused = subprocess.run(
        [*command, "--output", str(folder)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert refused.returncode == 2 and "already holds questions.jsonl" in refused.stderr, refused.stderr
    assert (folder / "questions.jsonl").read_text() == "my own questions\n" and not (
        folder / "clips"
    ).exists()
    replaced = subprocess.run(
        [*command, "--output", str(folder), "--overwrite"], capture_output=True, text=True, timeout=120
    )
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    assert (folder / "questions.jsonl").read_text() != "my own questions\n"
    blocked = tmp_path / "a file"
    blocked.write_text("")
    failed = subprocess.run(
        [*command, "--output", str(blocked / "set")], capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 2 and "cannot write the example set into" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr
