"""A sharded build reads each process's own part of the transformer's weights (models/shard_loading.py):
the same weights, shard for shard and bit for bit, as loading whole and then sharding, and about 1/N
of the bytes. Both ranks of 2 are built in this process, each on a fake process group of its own
(sharding a module needs no collective)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from omni_diffusion_rl.benchmarks.memory_tracing import fake_process_group
from omni_diffusion_rl.benchmarks.tiny_families import H3_CLIP, LTX2_CLIP, save_tiny_h3, save_tiny_ltx2
from omni_diffusion_rl.config import ModelConfig
from omni_diffusion_rl.models import build_nft_policy, shard_loading
from omni_diffusion_rl.runtime.sharding import Sharder, ShardingChoice

RANKS = 2


def _save(family: str, folder: Path) -> Path:
    return save_tiny_h3(folder) if family == "minimax_h3" else save_tiny_ltx2(folder)


def _sharder(family: str) -> Sharder:
    return Sharder(ShardingChoice(True, False, "the test"), family, None, torch.device("cpu"), RANKS)


def _local_states(cfg: ModelConfig, rank: int, read_shards_only: bool) -> tuple[dict, int]:
    """Rank `rank`'s local part of every transformer tensor, and the bytes its weights read."""
    read = []
    load = shard_loading.load_deferred_weights

    def counting(model: torch.nn.Module) -> int:
        read.append(load(model))
        return read[-1]

    defer = shard_loading.deferred_weights if read_shards_only else contextlib.nullcontext
    with (
        fake_process_group(RANKS, "the test", rank=rank),
        mock.patch.object(shard_loading, "deferred_weights", defer),
        mock.patch.object(shard_loading, "load_deferred_weights", counting),
    ):
        torch.manual_seed(0)  # the adapters' initial values
        policy = build_nft_policy(cfg, "cpu", _sharder(cfg.family).policy)
        tensors = [*policy.transformer.named_parameters(), *policy.transformer.named_buffers()]
        local = {n: (t.to_local() if hasattr(t, "to_local") else t).detach().clone() for n, t in tensors}
    return local, sum(read)


@pytest.mark.parametrize("family", ["minimax_h3", "ltx2"])
def test_each_rank_reads_its_own_rows_into_the_same_shards_as_a_whole_load(
    family: str, tmp_path: Path
) -> None:
    folder = _save(family, tmp_path / family)
    clip = H3_CLIP if family == "minimax_h3" else LTX2_CLIP
    cfg = ModelConfig(family, str(folder), base_dtype="bf16", lora_rank=4, lora_alpha=4.0, options=dict(clip))
    files = list((folder / "transformer").glob("*.safetensors"))
    file_bytes = sum(f.stat().st_size for f in files)
    for rank in range(RANKS):
        whole, whole_read = _local_states(cfg, rank, read_shards_only=False)
        parts, read = _local_states(cfg, rank, read_shards_only=True)
        assert whole_read == 0, "loading whole reads through from_pretrained, not per rank"
        assert 0 < read < 0.6 * file_bytes, f"rank {rank} read {read} of the files' {file_bytes} bytes"
        assert list(parts) == list(whole)
        dtypes = {t.dtype for t in parts.values()}
        assert torch.bfloat16 in dtypes and torch.float32 in dtypes, "a bf16 base beside fp32 adapters"
        for name, expected in whole.items():
            got = parts[name]
            assert got.dtype == expected.dtype and got.shape == expected.shape, name
            assert torch.equal(got, expected), f"rank {rank}: {name} differs"


def test_a_skeleton_whose_files_lack_a_weight_is_a_sentence(tmp_path: Path) -> None:
    folder = save_tiny_h3(tmp_path / "h3")
    weights = folder / "transformer" / shard_loading.WEIGHTS_NAME
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, str(weights))
    cfg = ModelConfig("minimax_h3", str(folder), lora_rank=4, lora_alpha=4.0, options=dict(H3_CLIP))
    with fake_process_group(RANKS, "the test"), pytest.raises(shard_loading.WeightLoadError) as caught:
        build_nft_policy(cfg, "cpu", _sharder("minimax_h3").policy)
    assert dropped in str(caught.value) and "in no safetensors file" in str(caught.value)


def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / shard_loading.INDEX_NAME).write_text(
        json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}})
    )
    with pytest.raises(shard_loading.WeightLoadError, match="not a file of"):
        shard_loading.weight_files(folder)


def test_a_folder_without_safetensors_has_no_weight_files(tmp_path: Path) -> None:
    assert shard_loading.weight_files(tmp_path) is None


def test_a_header_that_does_not_fit_its_file_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(4, 3)}, str(good))
    stored = shard_loading.read_header(good)["w"]
    assert torch.equal(
        shard_loading.read_rows(stored, 1, 2), torch.arange(3, 9, dtype=torch.float32).reshape(2, 3)
    )
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-4])  # the last tensor's bytes run past the end
    with pytest.raises(shard_loading.WeightLoadError, match="fit neither"):
        shard_loading.read_header(cut)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(shard_loading.WeightLoadError, match="not a safetensors file"):
        shard_loading.read_header(huge)
