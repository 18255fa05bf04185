"""The memory trace of one H3 training micro-step (benchmarks/memory_trace.py): on fake tensors it
counts what the same code holds on real tensors, and at the recipe's sample size it runs and shards."""

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
