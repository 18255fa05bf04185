"""GSPO on the shared loop with a small tiny omni model: it trains colocated (on-policy: the trainer's
log-probs equal the sampler's), resumes equal, refuses a checkpoint of another vocabulary, treats a
failing reward like the diffusion side, and its answers travel through the reward wire format."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.checkpoint import CheckpointError
from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.models.tiny_omni import TinyOmniConfig, TinyOmniModel, build_tokenizer
from omni_diffusion_rl.serving.wire import WireError, decode_media, encode_media
from omni_diffusion_rl.trainers.trainer import Trainer
from omni_diffusion_rl.world.avqa import vocabulary

from .helpers import step_records

pytestmark = pytest.mark.usefixtures("single_thread")
SMALL = TinyOmniConfig(hidden_size=64, layers=2, heads=2, kv_heads=1, intermediate_size=128)


def omni_model_dir(path: Path, words: list[str] | None = None) -> Path:
    torch.manual_seed(0)
    TinyOmniModel(SMALL, build_tokenizer(words or vocabulary())).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return omni_model_dir(tmp_path_factory.mktemp("omni"))


def gspo_overrides(model_dir: Path | str, run: Path, steps: int = 2, *extra: str) -> list[str]:
    return [
        "model.family=tiny_omni",
        f"model.pretrained={model_dir}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "algorithm.name=gspo",
        "algorithm.max_new_tokens=6",
        "data.prompts=builtin:tiny_avqa",
        "data.eval_prompts=builtin:tiny_avqa_heldout",
        "data.prompts_per_step=2",
        "data.group_size=4",
        "data.eval_samples=80",
        "reward.weights={avqa_exact: 1.0, answer_format: 0.5}",
        "eval.metrics=[]",
        f"train.output_dir={run}",
        f"train.steps={steps}",
        "train.preview_every=0",
        "train.progress=false",
        "tracking.wandb=false",
        "optim.lr=5e-3",
        *extra,
    ]


def test_gspo_trains_colocated_on_policy_and_reports_held_out_accuracy(tmp_path: Path) -> None:
    """The shipped base answers partly right, so groups have advantages and the adapter moves."""
    run = tmp_path / "run"
    overrides = gspo_overrides("builtin-omni", run, 3, "data.prompts_per_step=4")
    trainer = Trainer(load_config(None, overrides))
    summary = trainer.fit()
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["gspo/logp_gap"] < 1e-4 for r in rows), [r["gspo/logp_gap"] for r in rows]  # on policy
    assert all(abs(r["gspo/ratio_mean"] - 1) < 1e-4 for r in rows)
    assert all(0 < r["answers/mean_tokens"] <= 6 for r in rows)
    for when in ("before", "after"):
        accuracy = summary[f"heldout_accuracy_{when}"]
        assert {"greedy", "sampled", "greedy/color", "sampled/describe"} <= set(accuracy)
    assert summary["samples"]["trained"] == 3 * 4 * 4
    assert any(r["grad_norm"] > 0 for r in rows) and 0 < summary["heldout_accuracy_before"]["greedy"] < 1
    # the notebook's way in: load_policy gives the trained adapter, answering as the trainer does
    from omni_diffusion_rl.evaluation.avqa import answer_questions
    from omni_diffusion_rl.inference import load_policy
    from omni_diffusion_rl.world.avqa import HELDOUT_QUESTIONS

    asked = HELDOUT_QUESTIONS[:10]
    loaded = load_policy(run / "checkpoints")
    with torch.no_grad():
        theirs = answer_questions(trainer.policy.model, asked, 0, greedy=False)[0]
        ours = answer_questions(loaded.model, asked, 0, greedy=False)[0]
    assert ours == theirs
    from omni_diffusion_rl.cli import main

    assert main(["sample", "--checkpoint", str(run / "checkpoints"), "--prompt", "a red circle"]) == 2


def test_gspo_resumes_equal(tmp_path: Path) -> None:
    whole, split, model_dir = tmp_path / "whole", tmp_path / "split", "builtin-omni"
    Trainer(load_config(None, gspo_overrides(model_dir, whole, 3, "train.eval_at_start_and_end=false"))).fit()
    first = gspo_overrides(
        model_dir, split, 2, "train.eval_at_start_and_end=false", "train.checkpoint_every=2"
    )
    Trainer(load_config(None, first)).fit()
    resumed = Trainer(
        load_config(None, gspo_overrides(model_dir, split, 3, "train.eval_at_start_and_end=false"))
    )
    resumed.fit(resume=str(split / "checkpoints"))
    a, b = step_records(whole), step_records(split)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=1e-5, abs=1e-9)
    assert a[-1]["reward/mean"] == pytest.approx(b[-1]["reward/mean"], abs=1e-6)


def test_a_checkpoint_of_another_vocabulary_is_refused(model_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    Trainer(load_config(None, gspo_overrides(model_dir, run, 1, "train.eval_at_start_and_end=false"))).fit()
    other = omni_model_dir(tmp_path / "other", [*vocabulary(), "zebra"])
    trainer = Trainer(load_config(None, gspo_overrides(other, tmp_path / "again", 2)))
    with pytest.raises(CheckpointError, match="another model configuration"):
        trainer.load(run / "checkpoints")


def test_a_nan_reward_is_an_error_not_a_score(model_dir: Path, tmp_path: Path) -> None:
    from omni_diffusion_rl.registry import rewards
    from omni_diffusion_rl.reward import RewardError

    @rewards.register("nan_answers")
    class NaNAnswers:
        def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
            assert media.text is not None
            return torch.full((len(media.text),), float("nan"))

    overrides = gspo_overrides(model_dir, tmp_path / "run", 2, "reward.weights={nan_answers: 1.0}")
    with pytest.raises(RewardError):
        Trainer(load_config(None, [*overrides, "train.eval_at_start_and_end=false"])).fit()


def test_a_prompt_set_that_is_not_avqa_is_refused(model_dir: Path, tmp_path: Path) -> None:
    overrides = gspo_overrides(model_dir, tmp_path / "run", 1, "data.prompts=builtin:tiny_world")
    with pytest.raises(ValueError, match="not a tiny AVQA prompt"):
        Trainer(load_config(None, overrides))


def test_answers_travel_through_the_reward_wire_format() -> None:
    media = MediaBatch(
        video=torch.rand(2, 4, 3, 16, 16), audio=torch.zeros(2, 1, 80), text=["red", "a red circle"]
    )
    back, prompts = decode_media(encode_media(media, ["color | x", "describe | y"]))
    assert back.text == ["red", "a red circle"] and prompts == ["color | x", "describe | y"]
    from safetensors.torch import save as save_tensors

    def body(text: str) -> bytes:
        meta = {"prompts": '["a", "b"]', "fps": "8.0", "sample_rate": "8000", "text": text}
        return save_tensors({"audio": torch.zeros(2, 1, 8)}, metadata=meta)

    for bad, message in [
        ('["one"]', "1 text for a batch of 2"),
        ("[1, 2]", "list of strings"),
        ("{", "not JSON"),
        (f'["{"x" * 20000}", "b"]', "longer than"),
    ]:
        with pytest.raises(WireError, match=message):
            decode_media(body(bad))


@pytest.mark.slow  # starts launcher processes
@pytest.mark.parametrize("mode", ["separate", "hybrid"])
def test_gspo_runs_in_the_async_modes_unchanged(tmp_path: Path, mode: str) -> None:
    """Answers, their behaviour log-probs and question tokens travel through the replay buffer; the
    trainer's ratio is taken against what the rollout process sampled with (a version or more old)."""
    from .helpers import last_json_line
    from .test_separate import _launch

    run = tmp_path / "run"
    overrides = [
        *gspo_overrides("builtin-omni", run, 4, "train.eval_at_start_and_end=false"),
        f"execution.mode={mode}",
        "execution.data_timeout_s=60",
    ]
    proc = _launch(overrides, 29671 if mode == "separate" else 29673)
    assert proc.returncode == 0, proc.stderr[-4000:]
    buffer = last_json_line(proc.stdout)["execution"]["buffer"]
    assert buffer["trained"] == 4 * 2 * 4, buffer
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(0 < r["answers/mean_tokens"] <= 6 and 0 <= r["answers/truncated"] <= 1 for r in rows)
    # decided by the run's own counters: a step whose answers are all of the trainer's version
    # (staleness/max 0) is on policy; one with answers a version old, after an update that moved the
    # adapter (the previous step's grad_norm > 0), has ratios off 1 (taken against the old log-probs)
    histogram = buffer["staleness_histogram"]
    assert sum(histogram.values()) == buffer["trained"] and max(map(int, histogram)) <= 1, histogram
    assert all(r["gspo/logp_gap"] < 1e-4 for r in rows if r["staleness/max"] == 0), rows
    pairs = itertools.pairwise(rows)
    after_a_move = [r for prev, r in pairs if r["staleness/max"] >= 1 and prev["grad_norm"] > 0]
    assert after_a_move and all(r["gspo/ratio_max_dev"] > 1e-6 for r in after_a_move), rows


def test_cost_measurement_counts_answer_tokens(tmp_path: Path) -> None:
    """auto's warm-up times an answering policy at the run's own answer lengths: the cost model's
    length is the measured mean answer tokens, and forcing longer answers raises it."""
    from omni_diffusion_rl.execution.planner.measure import measure_costs

    def measured(*extra: str):  # noqa: ANN202
        cfg = load_config(None, gspo_overrides("builtin-omni", tmp_path / "m", 1, *extra))
        return measure_costs(cfg, 10, 10, repeats=1, replicas=2)

    natural = measured()
    forced = measured("algorithm.max_new_tokens=12", "algorithm.min_new_tokens=12")
    # the mean of one group's 4 answer lengths (a multiple of 1/4), at most max_new_tokens
    assert 1 <= natural.length <= 6 and (natural.length * 4).is_integer() and forced.length == 12.0
    for costs in (natural, forced):  # recomputed from the report's own points (seconds of one call)
        assert costs.points_length == costs.length  # measured at the one length: the points are kept
        assert [x for x, _ in costs.gen_points] == [4.0, 8.0] == [x for x, _ in costs.train_points]
        # the line through the 2 generation points, per answer token (clamped at 0 as costs are)
        (x1, y1), (x2, y2) = costs.gen_points
        per_token = (y2 - y1) / ((x2 - x1) * costs.length)
        assert costs.gen_per_unit_s == pytest.approx(max(0.0, per_token), rel=1e-6, abs=1e-12), costs
        fixed = y1 - per_token * x1 * costs.length
        assert costs.gen_fixed_s == pytest.approx(max(0.0, fixed), rel=1e-6, abs=1e-12), costs


def test_an_algorithm_and_a_model_that_do_not_fit_are_refused(model_dir: Path, tmp_path: Path) -> None:
    from omni_diffusion_rl.config import ConfigError

    from .helpers import fast_overrides, tiny_model_dir

    gspo_only = ("algorithm.max_new_tokens=",)  # gspo's own option: refused by name under nft
    nft_on_omni = [
        o
        for o in gspo_overrides(model_dir, tmp_path / "a", 1, "algorithm.name=nft")
        if not o.startswith(gspo_only)
    ]
    with pytest.raises(ConfigError, match="does not train an answering language model"):
        Trainer(load_config(None, nft_on_omni))
    generator = tiny_model_dir(tmp_path / "tiny")
    gspo_on_tiny_av = [*fast_overrides(generator, tmp_path / "b", 1), "algorithm.name=gspo"]
    with pytest.raises(ConfigError, match="does not train a media generator"):
        Trainer(load_config(None, gspo_on_tiny_av))


@pytest.mark.slow  # starts a reward server process
def test_a_reward_server_scores_concurrent_answers_each_with_its_own_text() -> None:
    """Answers batched from several requests into one model call keep their own rows and text. The
    server holds a batch until it has max_batch=16 samples, so the 16 one-answer requests are one
    model call whatever the threads' timing (its 30 s wait only stops a hang)."""
    import concurrent.futures as cf

    from omni_diffusion_rl.serving.client import RemoteReward
    from omni_diffusion_rl.serving.process import ServerProcess

    from .helpers import ENV, REPO

    prompt = "color | a red circle with a low tone at the start"
    batching = ("--max-batch", "16", "--max-wait-ms", "30000")
    with ServerProcess(["avqa_exact"], *batching, env=ENV, cwd=REPO) as server:
        client = RemoteReward(server.url, "avqa_exact")

        def one(i: int) -> float:
            media = MediaBatch(audio=torch.zeros(1, 1, 8), text=["red" if i % 2 == 0 else "blue"])
            return float(client.score(media, [prompt]).scores[0])

        with cf.ThreadPoolExecutor(16) as pool:
            scores = list(pool.map(one, range(16)))
        stats = client.info()["stats"]["avqa_exact"]
        client.close()
    assert scores == [1.0 if i % 2 == 0 else 0.0 for i in range(16)]
    assert (stats["requests"], stats["samples"], stats["model_calls"]) == (16, 16, 1), stats
