"""The memory trace of one H3 training micro-step (benchmarks/memory_trace.py): on fake tensors it
counts what the same code holds on real tensors, and at the recipe's size it runs and shards."""

from __future__ import annotations

import pytest

from omni_diffusion_rl.benchmarks.memory_trace import TINY_CASE, TraceCase, trace_update

GIB = 2**30


def test_the_trace_counts_what_the_same_step_holds_on_real_tensors() -> None:
    """A small H3 over 2 fake ranks: FSDPMemTracker's peak per category with fake tensors (no storage)
    against the same micro-step on real CPU tensors, within 10% (measured: equal)."""
    traced = trace_update(TINY_CASE, fake=True)["peak_gib"]
    real = trace_update(TINY_CASE, fake=False)["peak_gib"]
    assert traced.keys() == real.keys()
    for category, value in real.items():
        assert traced[category] == pytest.approx(value, rel=0.1, abs=1e-9), category
    assert real["Activation"] > 0 and real["Sharded Param"] > 0 and real["All Gather"] > 0
    assert real["Total"] >= real["Activation"] + real["Sharded Param"]


@pytest.mark.slow  # about 40 CPU-s: 48 blocks traced at 37,838 rows
def test_the_recipes_micro_step_traces_at_full_size_and_is_sharded_eight_ways() -> None:
    """The released H3 transformer (33.1B parameters, with LoRA r64 33.8B) at 124 frames of 768x1344 over 8
    ranks: each holds an eighth of the bf16 base and fp32 adapters, and the micro-step (gradient
    checkpointing, one sample) peaks under 72 GiB per rank (traced 48.2 GiB on 2026-12-06)."""
    result = trace_update(TraceCase())
    peak = result["peak_gib"]
    # the released config: 33.12B base parameters (bf16), 0.67B in the two LoRA r64 adapters (fp32)
    assert result["parameters_b"] == pytest.approx(33.12 + 0.665, rel=0.002)
    whole_gib = (33.12e9 * 2 + 0.665e9 * 4) / GIB
    assert peak["Sharded Param"] == pytest.approx(whole_gib / 8, rel=0.02)
    assert peak["Activation"] > 10, "37,838 rows x 5,376 wide, saved at every one of 48 blocks"
    assert peak["Total"] < 72
