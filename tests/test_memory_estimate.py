"""`odrl bench memory`: the on-paper estimate adds up its parts, counts the released sizes, and
moves the way the recipe's knobs and the sharding layout should move it."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from omni_diffusion_rl.benchmarks.memory import (
    CARDS_GB,
    GIB,
    Estimate,
    Layout,
    Unit,
    estimate_config,
    estimate_h3,
    estimate_ltx2,
    run_memory_bench,
    transformer_parts,
)
from omni_diffusion_rl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("recipes/configs/h3_av_nft.yaml", "recipes/configs/ltx2_av_nft.yaml")
PARTS = (
    "transformer_gib",
    "gathered_gib",
    "text_encoder_gib",
    "vaes_gib",
    "lora_gib",
    "activations_gib",
    "overhead_gib",
)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Estimate], dict, str]:
    """The bench run once: its estimates, its JSON and what it printed."""
    output = tmp_path_factory.mktemp("bench") / "memory.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        estimates = run_memory_bench(output)
    return estimates, json.loads(output.read_text()), printed.getvalue()


def test_the_estimate_adds_up_and_follows_the_knobs(bench: tuple[list[Estimate], dict, str]) -> None:
    estimates, data, out = bench
    rows = data["estimates"]
    assert "| recipe | processes | sharding | offload | transformer |" in out and len(rows) == len(estimates)
    for row in rows:
        assert row["total_gib"] == pytest.approx(sum(row[k] for k in PARTS))
    whole = [e for e in estimates if e.sharding == "none"]
    assert len(whole) == 4 and all(e.gathered_gib == 0 and e.processes == 8 for e in whole)
    ltx2, h3_offloaded, h3_on_gpu, h3_short = whole
    assert ltx2.transformer_gib * GIB / 2 == pytest.approx(18.88e9, rel=0.01)  # LTX-2's 19B, bf16
    assert h3_offloaded.transformer_gib * GIB / 2 == pytest.approx(33.12e9, rel=0.01)  # H3's 33B, bf16
    assert h3_offloaded.text_encoder_gib == 0 and 40 < h3_on_gpu.text_encoder_gib < 60
    assert h3_short.activations_gib < h3_offloaded.activations_gib / 3
    assert estimate_h3(rank=128).lora_gib == pytest.approx(2 * h3_offloaded.lora_gib)


@pytest.mark.parametrize("processes", [8, 16])
def test_sharding_divides_the_transformer_and_lora_but_not_the_rest(processes: int) -> None:
    whole = estimate_ltx2()
    sharded = estimate_ltx2(layout=Layout(processes, "fsdp"))
    # 1/N of every weight and adapter, FSDP2's dim-0 padding to a multiple of N at most adding a little
    assert (
        whole.transformer_gib / processes
        <= sharded.transformer_gib
        <= 1.001 * whole.transformer_gib / processes
    )
    assert whole.lora_gib / processes <= sharded.lora_gib <= 1.001 * whole.lora_gib / processes
    for part in ("text_encoder_gib", "vaes_gib", "activations_gib", "overhead_gib"):
        assert getattr(sharded, part) == getattr(whole, part)  # frozen helpers and activations: per process
    # the gathered blocks: at least two LTX-2 blocks (0.39B parameters each) whole in bf16
    assert 2 * 0.386e9 * 2 / GIB < sharded.gathered_gib < 3


def test_the_padding_is_counted_per_parameter_on_dim_0() -> None:
    units = [Unit(base=((5, 3), (2,)), lora=((4, 3), (5, 4)))] * 3
    rest = Unit(base=((7,),))
    whole = transformer_parts(units, rest, Layout(4))
    sharded = transformer_parts(units, rest, Layout(4, "fsdp"))
    # per process: ceil(5/4)=2 rows of 3 and ceil(2/4)=1 of each block, ceil(7/4)=2 of the rest; bf16
    assert sharded["transformer_gib"] * GIB == (3 * (2 * 3 + 1) + 2) * 2
    assert whole["transformer_gib"] * GIB == (3 * (15 + 2) + 7) * 2
    # adapters: ceil(4/4)=1 row of 3 and ceil(5/4)=2 rows of 4 per block, 20 bytes each
    assert sharded["lora_gib"] * GIB == 3 * (3 + 8) * 20
    # gathered: two blocks as the padded all-gather returns them (8 and 4 rows) plus the rest whole
    assert sharded["gathered_gib"] * GIB == 2 * ((8 * 3 + 4) * 2 + (4 * 3 + 8 * 4) * 12) + 7 * 2


def test_the_gathered_blocks_do_not_shrink_with_more_processes() -> None:
    gathered = [estimate_h3(layout=Layout(n, "fsdp")).gathered_gib for n in (2, 8, 16, 64)]
    assert gathered[0] > 2 * 0.645e9 * 2 / GIB  # two H3 blocks (0.65B parameters each) in bf16
    assert all(later >= gathered[0] for later in gathered[1:])
    assert estimate_h3(layout=Layout(8, "fsdp", cpu_offload=True)).gathered_gib == gathered[1]


def test_offload_takes_the_shards_off_the_gpu() -> None:
    sharded = estimate_h3(layout=Layout(8, "fsdp"))
    offloaded = estimate_h3(layout=Layout(8, "fsdp", cpu_offload=True))
    assert offloaded.transformer_gib == 0 and offloaded.lora_gib == 0
    assert offloaded.total_gib == pytest.approx(
        sharded.total_gib - sharded.transformer_gib - sharded.lora_gib
    )
    with pytest.raises(ValueError, match="sharding='fsdp'"):
        Layout(8, "none", cpu_offload=True)


def test_the_table_and_json_state_the_layout_and_the_smallest_card(
    bench: tuple[list[Estimate], dict, str],
) -> None:
    estimates, data, out = bench
    assert data["cards_gb"] == list(CARDS_GB)
    for row in data["estimates"]:
        assert {"processes", "sharding", "cpu_offload", "gathered_gib", "smallest_card_gb"} <= row.keys()
        card = row["smallest_card_gb"]
        assert card is None or (
            row["total_gib"] <= card and all(row["total_gib"] > c for c in CARDS_GB if c < card)
        )
    for recipe in ("ltx2_av_nft", "h3_av_nft (124 frames 768x1344, LoRA 64, conditioner offloaded)"):
        layouts = {(e.sharding, e.cpu_offload) for e in estimates if e.recipe.startswith(recipe)}
        assert layouts == {("none", False), ("fsdp", False), ("fsdp", True)}, recipe
    rows = [line for line in out.splitlines() if line.startswith(("| h3_av_nft", "| ltx2"))]
    named = {f"{card} GB |" for card in CARDS_GB} | {f"none (> {CARDS_GB[-1]} GB) |"}
    assert len(rows) == len(estimates)
    assert {row.split(" | ")[-1] for row in rows} <= named  # every row names its smallest card
    assert "| 8 | fsdp | yes |" in out and "| 8 | none | no |" in out
    h3_whole = next(e for e in estimates if e.recipe.startswith("h3_av_nft (124") and e.sharding == "none")
    assert h3_whole.smallest_card_gb == 141  # whole copies of the 33B base: an H200-class card


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_as_shipped_fits_80_gib_sharded_over_8_processes(recipe: str) -> None:
    cfg = load_config(ROOT / recipe)
    assert cfg.train.sharding == "fsdp"
    estimate = estimate_config(cfg, processes=8)
    assert estimate.sharding == "fsdp" and estimate.processes == 8
    assert estimate.total_gib <= 80 and estimate.smallest_card_gb is not None
    assert estimate.smallest_card_gb <= 80
    if cfg.model.family == "minimax_h3":  # the seed's clip size, as in the recipe
        assert (cfg.model.options["num_frames"], cfg.model.options["height"]) == (124, 768)
        assert "124 frames 768x1344" in estimate.recipe
    whole = estimate_config(load_config(ROOT / recipe, ["train.sharding=none"]), processes=8)
    assert math.isclose(whole.gathered_gib, 0) and whole.total_gib > estimate.total_gib


def test_a_config_outside_the_estimate_is_refused() -> None:
    cfg = load_config(ROOT / RECIPES[1], ["train.micro_batch_size=2"])
    with pytest.raises(ValueError, match="micro_batch_size=1"):
        estimate_config(cfg)


@pytest.mark.parametrize("recipe", RECIPES)
def test_check_says_what_a_rollout_process_of_the_async_modes_holds(recipe: str) -> None:
    """`odrl train --check` in separate or hybrid mode: a note that each rollout process holds whole
    copies, with the whole weights on paper (none in colocated mode, where every process shards)."""
    from omni_diffusion_rl.benchmarks.memory import check_rollout_memory
    from omni_diffusion_rl.preflight import NOTE

    whole = estimate_config(load_config(ROOT / recipe, ["train.sharding=none"]), processes=1)
    weights = (
        whole.transformer_gib + whole.text_encoder_gib + whole.vaes_gib + whole.lora_gib + whole.overhead_gib
    )
    for mode in ("separate", "hybrid"):
        (note,) = check_rollout_memory(load_config(ROOT / recipe, [f"execution.mode={mode}"]))
        assert note.status == NOTE and f"{mode}: each rollout process holds whole copies" in note.detail
        assert f"{weights:.0f} GiB of weights on paper" in note.detail and weights > 60
    assert check_rollout_memory(load_config(ROOT / recipe)) == []


@pytest.mark.slow  # the estimate builds LTX-2 and Gemma 3 12B on the meta device (about 15 s)
def test_odrl_train_check_prints_the_rollout_processes_note(capsys: pytest.CaptureFixture[str]) -> None:
    from .helpers import odrl_main

    recipe = str(ROOT / RECIPES[1])
    code, out, _ = odrl_main(capsys, "train", recipe, "--check", "execution.mode=hybrid")
    assert code == 1, out  # the weights are not downloaded here
    assert "note     execution.mode" in out and "hybrid: each rollout process holds whole copies" in out
