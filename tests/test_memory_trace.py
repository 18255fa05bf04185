"""The memory traces of H3 (benchmarks/memory_trace.py), one training micro-step and the rollout's
decode: on fake tensors each counts what the same code holds on real tensors, and at the recipe's
sizes they run (the micro-step sharded eight ways)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omni_diffusion_rl.benchmarks.memory_trace import (
    TINY_CASE,
    TINY_DECODE,
    DecodeCase,
    TraceCase,
    trace_decode,
    trace_update,
)
from omni_diffusion_rl.benchmarks.memory_trace_ltx2 import TINY_LTX2, Ltx2Case, trace_ltx2_update

GIB = 2**30


@pytest.mark.parametrize("train", [True, False], ids=["micro-step", "forward without gradients"])
@pytest.mark.parametrize(
    ("size", "ranks"),
    [
        pytest.param(0, 2, id="small-2 ranks"),
        pytest.param(0, 1, id="small-1 rank", marks=pytest.mark.slow),  # the fast tier keeps one layout
        pytest.param(1, 1, id="larger-1 rank", marks=pytest.mark.slow),
        pytest.param(1, 2, id="larger-2 ranks", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("family", ["tiny_av", "minimax_h3", "ltx2"])
def test_the_trace_counts_what_the_same_step_holds_on_real_tensors(
    family: str, size: int, ranks: int, train: bool
) -> None:
    """Each family at two small sizes over 1 and 2 fake ranks: FSDPMemTracker's peak per category with
    fake tensors (no storage) against the same micro-step (or rollout forward) on real CPU tensors,
    within 10% (measured: equal but for 4 bytes of H3's activations without gradients)."""
    from omni_diffusion_rl.benchmarks.memory_trace_check import compare

    row = compare(family, size, ranks, train)
    traced, real = row["traced_gib"], row["real_gib"]
    assert traced.keys() == real.keys()
    assert row["largest_relative_difference"] <= 0.1, row
    assert real["Activation"] > 0 and real["Sharded Param"] > 0
    assert real["Total"] >= real["Activation"] + real["Sharded Param"]
    if ranks > 1:
        assert real["All Gather"] > 0, "a sharded block is gathered before it runs"


def test_a_second_rank_halves_the_sharded_weights() -> None:
    """The same small H3 over 1 and 2 fake ranks: rank 0 holds all of the sharded weights, then about
    half (dim-0 rows of every parameter; an odd row count rounds up)."""
    one, two = (trace_update(replace(TINY_CASE, ranks=n), fake=False)["peak_gib"] for n in (1, 2))
    assert two["Sharded Param"] == pytest.approx(one["Sharded Param"] / 2, rel=0.05)


def test_the_recipes_sample_at_full_width_is_sharded_eight_ways() -> None:
    """The recipe's sample (124 frames at 768x1344: 37,838 rows) through H3 at its released width,
    4 of its blocks (the whole model is `odrl bench memory --trace`, 40 s), LoRA r64, over 8 ranks:
    each rank holds an eighth of the bf16 base and fp32 adapters, and saves activations for the
    backward at every block."""
    case = TraceCase(name="4 released blocks", transformer={"num_layers": 4})
    result = trace_update(case)
    peak = result["peak_gib"]
    base, adapters = result["parameters_b"] - result["adapter_parameters_b"], result["adapter_parameters_b"]
    assert 0 < adapters < 0.05 * base
    assert peak["Sharded Param"] == pytest.approx((base * 2 + adapters * 4) * 1e9 / GIB / 8, rel=0.02)
    assert peak["Activation"] > 5, "37,838 rows x 5,376 wide at 4 blocks"
    assert peak["Total"] > peak["Sharded Param"] + peak["Activation"]


def test_the_decode_trace_counts_what_the_same_decode_holds_on_real_tensors() -> None:
    """MiniMaxH3Policy.decode of 3 clips through the tiny VAEs: MemTracker's peak per category with
    fake tensors against the same decode on real CPU tensors (measured: equal)."""
    traced = trace_decode(TINY_DECODE, fake=True)
    real = trace_decode(TINY_DECODE, fake=False)
    assert traced["peak_gib"] == pytest.approx(real["peak_gib"], rel=1e-6, abs=1e-12)
    assert traced["frames_gib"] == real["frames_gib"] == 3 * 22 * 3 * 32 * 32 * 4 / GIB
    assert real["peak_gib"]["Activation"] > real["frames_gib"], "the frames are among what the decode makes"


def test_each_further_clip_adds_what_the_second_added() -> None:
    """With vae_slicing each clip is decoded alone into frames made once for all: the third clip
    adds what the second did (within 0.1%, on real tensors), which lets the benchmark trace two
    clips at full size and state the recipe's sixteen."""
    totals = [
        trace_decode(replace(TINY_DECODE, samples=n), fake=False)["peak_gib"]["Total"] for n in (1, 2, 3)
    ]
    second, third = totals[1] - totals[0], totals[2] - totals[1]
    assert second > 0 and third == pytest.approx(second, rel=1e-3)


@pytest.mark.slow  # the released 2.6B-parameter VAE over 28 tiles of one chunk (about 6 s)
def test_the_released_vaes_hold_their_weights_in_the_recipes_dtypes() -> None:
    """One clip of one VAE chunk (22 frames) at 256x256 through the released VAEs' configs: the
    weights are the video VAE in bf16 and the audio VAE in fp32, and the decode's own tensors come
    on top of them."""
    result = trace_decode(DecodeCase(samples=1, frames=22, height=256, width=256))
    vae_bytes = result["vae_parameters_b"] * 1e9 * 2
    assert result["vae_parameters_b"] == pytest.approx(2.604, rel=1e-3)
    assert result["peak_gib"]["Parameter"] * GIB == pytest.approx(vae_bytes + 0.1513e9 * 4, rel=1e-3)
    assert result["peak_gib"]["Activation"] > result["frames_gib"] > 0


@pytest.mark.slow  # 2 released blocks of 18.9B parameters' width (about 5 s)
def test_ltx2s_sample_at_full_width_is_sharded_eight_ways() -> None:
    """The recipe's sample (121 frames at 512x768) through 2 of LTX-2's released blocks (the whole
    model is `odrl bench memory --trace`), LoRA r64 on every attention's q/k/v/out, over 8 ranks:
    each rank holds an eighth of the bf16 base and fp32 adapters."""
    result = trace_ltx2_update(Ltx2Case(name="2 released blocks", transformer={"num_layers": 2}))
    peak = result["peak_gib"]
    base, adapters = result["parameters_b"] - result["adapter_parameters_b"], result["adapter_parameters_b"]
    assert 0 < adapters < 0.1 * base
    assert peak["Sharded Param"] == pytest.approx((base * 2 + adapters * 4) * 1e9 / GIB / 8, rel=0.02)
    assert peak["Activation"] > 0 and peak["Total"] > peak["Sharded Param"] + peak["Activation"]


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
@pytest.mark.parametrize("train", [True, False], ids=["micro-step", "forward without gradients"])
def test_the_qwen_trace_counts_what_the_same_gspo_pass_holds_on_real_tensors(
    train: bool, family: str
) -> None:
    """The tests' tiny Qwen2.5-Omni thinker, and the tiny Qwen3-Omni-MoE one with gradient
    checkpointing (bf16: its experts' grouped products), through answer_log_probs (GSPO's pass;
    whole, not sharded): fake tensors against real ones, in all within 10% (measured: Qwen2.5 6%
    over, one logits-sized activation more; Qwen3 8% and 2%), the weights exactly."""
    from omni_diffusion_rl.benchmarks.memory_trace_qwen import TINY_QWEN, TINY_QWEN3, trace_qwen_update

    case = TINY_QWEN3 if family == "qwen3_omni" else TINY_QWEN
    traced = trace_qwen_update(case, fake=True, train=train)
    real = trace_qwen_update(case, fake=False, train=train)
    assert traced["prompt_positions"] == real["prompt_positions"] > case.question_tokens
    assert traced["peak_gib"]["Total"] == pytest.approx(real["peak_gib"]["Total"], rel=0.1)
    assert traced["peak_gib"]["Parameter"] == real["peak_gib"]["Parameter"] > 0
    assert real["peak_gib"]["Activation"] > 0


def test_the_reward_trace_counts_what_the_same_request_holds_on_real_tensors() -> None:
    """ImageBind (the tests' tiny architecture) on a small request: the frames it reads and its
    forward, fake tensors against real ones (measured: equal); the frames read are a small part of
    the request's."""
    from omni_diffusion_rl.benchmarks.memory_trace_rewards import RewardCase, trace_imagebind

    case = RewardCase(samples=2, frames=24, height=256, width=320, tiny=True)
    traced, real = (trace_imagebind(case, fake=fake) for fake in (True, False))
    assert traced["preprocess_gib"] == pytest.approx(real["preprocess_gib"], rel=1e-6)
    assert traced["forward_gib"] == pytest.approx(real["forward_gib"], rel=1e-6, abs=1e-12)
    assert 0 < real["preprocess_gib"] < real["request_frames_gib"]
    assert real["forward_gib"]["Parameter"] > 0 and real["forward_gib"]["Activation"] > 0


def test_the_clap_trace_counts_what_the_same_forward_holds_on_real_tensors() -> None:
    """CLAP (the tests' tiny model) on a small request, its audio and text towers as ClapReward.embed
    calls them: fake tensors against real ones (measured: equal), and the features the audio tower
    reads are the window's mels, one copy a clip."""
    from omni_diffusion_rl.benchmarks.memory_trace_rewards import RewardCase, trace_clap

    case = RewardCase(samples=2, text_tokens=12, tiny=True)
    traced, real = (trace_clap(case, fake=fake) for fake in (True, False))
    assert traced["forward_gib"] == pytest.approx(real["forward_gib"], rel=1e-6, abs=1e-12)
    assert real["features_gib"] * GIB == 2 * 101 * 16 * 4, "1 s at 48 kHz, hop 480, 16 mel bins"
    assert real["forward_gib"]["Parameter"] > 0 and real["forward_gib"]["Activation"] > 0


def test_the_ltx2_decode_trace_counts_what_the_same_decode_holds_on_real_tensors() -> None:
    """LTX2Policy.decode of 3 clips of the tiny LTX-2: fake tensors against real ones (measured: equal)."""
    from omni_diffusion_rl.benchmarks.memory_trace_ltx2 import trace_ltx2_decode

    traced, real = (trace_ltx2_decode(TINY_LTX2, 3, fake=fake)["peak_gib"] for fake in (True, False))
    assert traced == pytest.approx(real, rel=1e-6, abs=1e-12)
    assert real["Parameter"] > 0 and real["Activation"] > 0


def test_the_ltx2_prompt_trace_counts_what_the_same_encoding_holds_on_real_tensors() -> None:
    """LTX2Policy.encode_prompts of 2 prompts through the tiny Gemma and connectors: fake tensors
    against real ones (measured: equal); the condition is both streams, padded to the limit."""
    from omni_diffusion_rl.benchmarks.memory_trace_ltx2 import trace_ltx2_prompts

    traced, real = (trace_ltx2_prompts(TINY_LTX2, 2, fake=fake) for fake in (True, False))
    assert traced["peak_gib"] == pytest.approx(real["peak_gib"], rel=1e-6, abs=1e-12)
    assert (
        real["condition_gib"] * GIB == 2 * 2 * TINY_LTX2.text_tokens * 16 * 4 + 2 * TINY_LTX2.text_tokens * 8
    )
    assert real["peak_gib"]["Parameter"] > 0 and real["peak_gib"]["Activation"] > 0


@pytest.mark.slow  # Gemma 3 12B on fake tensors over 1,024 tokens (about 6 s)
def test_every_ltx2_rank_holds_the_released_text_encoder_whole() -> None:
    """The released Gemma 3 12B (with its vision tower) and the connectors in bf16 are every rank's
    (not sharded); a second prompt adds its own hidden states, not a second copy of the weights."""
    from omni_diffusion_rl.benchmarks.memory_trace_ltx2 import trace_ltx2_prompts

    one, two = (trace_ltx2_prompts(Ltx2Case(), n) for n in (1, 2))
    assert one["text_encoder_parameters_b"] == pytest.approx(12.87, rel=1e-3)
    assert one["peak_gib"]["Parameter"] == two["peak_gib"]["Parameter"] > 12.87e9 * 2 / GIB
    assert two["peak_gib"]["Activation"] == pytest.approx(2 * one["peak_gib"]["Activation"], rel=0.01)


def test_the_released_ltx2_decodes_the_recipes_clip_size() -> None:
    """The trace's released VAEs decode the recipe's latents to 121 frames of 512 x 768 (the class's
    default config alone reports 64x and 16x compression and decodes 57 frames of 256 x 384)."""
    from omni_diffusion_rl.benchmarks.memory_trace_ltx2 import trace_ltx2_decode

    result = trace_ltx2_decode(Ltx2Case(), 1)
    assert result["frames_gib"] * GIB == 121 * 3 * 512 * 768 * 4
