"""Qwen2.5-Omni-7B's thinker under GSPO at the recipe's size (qwen2_5_omni_avqa_gspo: 4 processes, 128
answers a step, micro-batches of 4), traced per process without a GPU.

The thinker is built from the released 7B configuration on the meta device in bf16 (the recipe's
base_dtype), wrapped in the project's QwenOmniModel with the recipe's clip (2 fps, 4 s, 224-pixel
frames) and Qwen's own processors (WhisperFeatureExtractor with 128 mel bins at 16 kHz, the Qwen2-VL
image processor), and given the project's LoRA r32 adapters on the language model. How many
positions a prompt takes comes from the model's own processing of a clip of that format (template,
video and audio tokens) and the question's tokens. The storage is then made of fake tensors, and one
micro-batch runs `QwenOmniModel.answer_log_probs` (the teacher-forced pass GSPO's loss takes:
full-vocabulary logits, the suppressed tokens masked, the answers' log-probs), its backward and an
AdamW step under torch's MemTracker. GSPO's answering models are never sharded (their sampler stops
when every answer on a process has ended), so every process holds the whole thinker.

`QWEN3_CASE` is Qwen3-Omni-30B-A3B's recipe (qwen3_omni_avqa_gspo: micro-batches of 2, gradient
checkpointing), its thinker built from the released configuration (RELEASED_30B_A3B: 48 layers of
128 experts, 8 a token, through transformers' grouped matrix products, which fake tensors follow in
bf16).

Not traced here: the towers' forward that builds the prompt's embeddings (frozen and without
gradients: nothing of it outlives the call), the rollout's sampling with its cache, and Qwen3-Omni's
deepstack additions at the video positions (transformers indexes them with a boolean mask, a shape
fake tensors cannot know; on paper a copy of the hidden states per deepstack layer,
`deepstack_on_paper_gib`). The tiny
thinker of the tests runs the same code on real tensors (`fake=False`), so the trace can be checked
against bytes that really exist; a test does so. The tokenizer is the tiny one of the tests (the
released one cannot be downloaded here): its template takes a few more tokens than Qwen's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from ..precision import default_dtype
from .memory_tracing import GIB, peak_on

RELEASED_7B = {  # Qwen/Qwen2.5-Omni-7B's thinker_config (text, audio and vision parts)
    "text_config": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": False,
    },
    "audio_config": {
        "d_model": 1280,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "num_mel_bins": 128,
        "output_dim": 3584,
        "n_window": 100,
        "max_source_positions": 1500,
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "out_hidden_size": 3584,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}


RELEASED_30B_A3B = {  # Qwen/Qwen3-Omni-30B-A3B-Instruct's thinker_config (text, audio and vision parts)
    "text_config": {
        "hidden_size": 2048,
        "intermediate_size": 768,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "vocab_size": 152064,
        "max_position_embeddings": 65536,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
    },
    "audio_config": {
        "d_model": 1280,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "num_mel_bins": 128,
        "output_dim": 2048,
        "n_window": 50,
        "n_window_infer": 800,
        "downsample_hidden_size": 480,
        "max_source_positions": 1500,
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 2048,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
}


class _NoHook:
    def remove(self) -> None:
        pass


class FrozenBaseTracker(MemTracker):
    """torch's MemTracker for a model with a frozen base: it hooks every parameter's gradient when
    its module first runs, which a parameter that needs none refuses; `skip_frozen` marks those as
    hooked already, so only the trained parameters' gradients are hooked (and counted as such)."""

    def skip_frozen(self, model: torch.nn.Module) -> None:
        for param in model.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())


@dataclass(frozen=True)
class QwenCase:
    """The GSPO recipe's micro-batch; `tiny`: the tests' tiny thinker, which really runs here."""

    name: str = "qwen2_5_omni_avqa_gspo (per process of 4)"
    micro_batch: int = 4  # train.micro_batch_size
    answer_tokens: int = 64  # algorithm.max_new_tokens: a micro-batch padded to the longest answer
    question_tokens: int = 24
    fps: float = 2.0
    seconds: float = 4.0
    frame_size: int = 224
    lora_rank: int = 32
    tiny: bool = False
    family: str = "qwen2_5_omni"  # or qwen3_omni
    gradient_checkpointing: bool = False  # model.gradient_checkpointing


TINY_QWEN = QwenCase(
    name="tiny Qwen2.5-Omni thinker",
    answer_tokens=6,
    question_tokens=5,
    fps=8.0,
    seconds=0.5,
    frame_size=16,
    lora_rank=4,
    tiny=True,
)


TINY_QWEN3 = QwenCase(
    name="tiny Qwen3-Omni thinker",
    micro_batch=2,
    answer_tokens=6,
    question_tokens=5,
    fps=8.0,
    seconds=0.5,
    frame_size=32,
    lora_rank=4,
    tiny=True,
    family="qwen3_omni",
    gradient_checkpointing=True,
)
QWEN3_CASE = QwenCase(
    name="qwen3_omni_avqa_gspo (per process of 4)",
    micro_batch=2,
    family="qwen3_omni",
    gradient_checkpointing=True,
)


def _released_thinker(tokenizer: Any, family: str) -> torch.nn.Module:
    """The released thinker of `family` (Qwen2.5-Omni-7B's, Qwen3-Omni-30B-A3B's) on the meta device
    in bf16, its media token ids those of `tokenizer`."""
    import transformers

    from .tiny_qwen import qwen3_thinker_token_ids, thinker_token_ids

    if family == "qwen3_omni":
        marks = qwen3_thinker_token_ids(tokenizer)
        config = transformers.Qwen3OmniMoeThinkerConfig(**RELEASED_30B_A3B, **marks)
        thinker_class = transformers.Qwen3OmniMoeThinkerForConditionalGeneration
    else:
        config = transformers.Qwen2_5OmniThinkerConfig(**RELEASED_7B, **thinker_token_ids(tokenizer))
        thinker_class = transformers.Qwen2_5OmniThinkerForConditionalGeneration
    with default_dtype(torch.bfloat16), torch.device("meta"):
        return thinker_class(config).eval()


def _qwen_model(case: QwenCase) -> Any:
    """QwenOmniModel at `case`'s clip over the released thinker with Qwen's processors, or over the
    tests' tiny thinker and processors."""
    from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor

    from ..models.qwen_omni import Qwen3OmniModel, QwenOmniModel
    from .tiny_qwen import QWEN3_MARKERS, WHISPER_7B, build_processors, build_thinker, build_tokenizer

    torch.manual_seed(0)
    qwen3 = case.family == "qwen3_omni"
    tokenizer = build_tokenizer(markers=QWEN3_MARKERS if qwen3 else None)
    clip = {"fps": case.fps, "seconds": case.seconds, "frame_size": case.frame_size}
    if case.tiny and qwen3:
        from .tiny_qwen3 import build_thinker as build_qwen3_thinker

        thinker = build_qwen3_thinker(tokenizer).to(torch.bfloat16)  # fake grouped products need bf16
        return Qwen3OmniModel(thinker, tokenizer, *build_processors(patch_size=16), **clip)
    if case.tiny:
        return QwenOmniModel(build_thinker(tokenizer), tokenizer, *build_processors(), **clip)
    audio = WhisperFeatureExtractor(**WHISPER_7B)  # Qwen2.5-Omni-7B's settings, for both families
    image = Qwen2VLImageProcessorPil(patch_size=16 if qwen3 else 14, temporal_patch_size=2, merge_size=2)
    model_class = Qwen3OmniModel if qwen3 else QwenOmniModel
    return model_class(_released_thinker(tokenizer, case.family), tokenizer, audio, image, **clip)


def trace_qwen_update(case: QwenCase, fake: bool = True, train: bool = True) -> dict[str, Any]:
    """Peak bytes of one process over one GSPO micro-step of `case` (MemTracker's categories, GiB);
    `train=False`: the same pass without gradients (the log-probs of a reference or a recheck)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..models.lora import add_nft_adapters, trainable_parameters
    from ..models.qwen_omni import Qwen3OmniPolicy, QwenOmniPolicy, QwenPrompted, language_model_targets

    model = _qwen_model(case)
    policy = Qwen3OmniPolicy if case.family == "qwen3_omni" else QwenOmniPolicy
    targets = list(language_model_targets(model.thinker, policy.lora_names))  # what the trainer adapts
    with torch.device("meta") if not case.tiny else torch.device("cpu"):
        add_nft_adapters(model, case.lora_rank, 2 * case.lora_rank, targets)
    if case.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    prompt = model.media_tokens + case.question_tokens
    deepstack_layers = len(getattr(model.thinker.config.vision_config, "deepstack_visual_indexes", ()) or ())
    suppressed = model.suppressed
    batch, hidden = case.micro_batch, int(model.thinker.config.get_text_config().hidden_size)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device("cpu"):
        if not case.tiny:
            model.to_empty(device="cpu")  # the values do not matter to the bytes held
            model.suppressed = suppressed  # a buffer of token ids, as loading keeps it
        positions = torch.arange(prompt).expand(3, batch, prompt)
        prompted = QwenPrompted(
            torch.randn(batch, prompt, hidden, dtype=model.thinker.dtype),
            torch.ones(batch, prompt, dtype=torch.long),
            positions,
            torch.full((batch,), prompt),
            None,
            (),  # Qwen3-Omni's deepstack additions are not traced (module docstring)
        )
        answers = torch.randint(0, len(model.tokenizer), (batch, case.answer_tokens))
        answer_mask = torch.ones(batch, case.answer_tokens, dtype=torch.bool)
        optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-5) if train else None
        tracker = FrozenBaseTracker()
        tracker.skip_frozen(model)
        tracker.track_external(model, *([optimizer] if optimizer else []))
        with tracker, torch.set_grad_enabled(train), torch.autocast("cpu", dtype=torch.bfloat16):
            logp = model.answer_log_probs(prompted, answers, answer_mask)
            if optimizer is not None:
                logp.float().square().mean().backward()  # a stand-in for GSPO's loss over the same log-probs
                optimizer.step()
        peak = peak_on(tracker.get_tracker_snapshot("peak"))
    return {
        "case": asdict(case),
        "fake_tensors": fake,
        "train": train,
        "prompt_positions": prompt,
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "adapter_parameters_b": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) / 1e9,
        # what the untraced deepstack additions hold: a copy of the hidden states per deepstack layer
        "deepstack_on_paper_gib": deepstack_layers * batch * (prompt + case.answer_tokens) * hidden * 2 / GIB,
        "peak_gib": {str(k): v / GIB for k, v in peak.items()},
    }


def on_paper_gib(result: dict[str, Any], vocab: int = 152064) -> dict[str, float]:
    """What a count of the parts gives: the whole thinker in bf16, both adapters in fp32 with the
    trained one's gradient and AdamW moments, and the logits (bf16 over every position, fp32 over
    the answers')."""
    case = result["case"]
    adapters = result["adapter_parameters_b"] * 1e9
    base = result["parameters_b"] * 1e9 - adapters
    answers = case["micro_batch"] * case["answer_tokens"]
    positions = case["micro_batch"] * result["prompt_positions"] + answers
    return {
        "weights": base * 2 / GIB,
        "adapters_and_adamw": adapters * 4 * (1 + 3 / 2) / GIB,  # both adapters, the trained one's 3 states
        "logits": (positions * vocab * 2 + answers * vocab * 4) / GIB,
    }


def run_qwen_trace(output: Path) -> dict[str, Any]:
    """Trace each Qwen recipe's micro-step and the same pass without gradients (Qwen2.5-Omni-7B's,
    Qwen3-Omni-30B-A3B's); print, write JSON (a section a family)."""
    report: dict[str, Any] = {"unit": "GiB"}
    for label, case in (("Qwen2.5-Omni-7B", QwenCase()), ("Qwen3-Omni-30B-A3B", QWEN3_CASE)):
        step, forward = (trace_qwen_update(case, train=train) for train in (True, False))
        paper = on_paper_gib(step)
        peak = step["peak_gib"]
        checkpointing = ", gradient checkpointing" if case.gradient_checkpointing else ""
        print(
            f"{label}'s thinker under GSPO, per process of 4 (whole, not sharded{checkpointing}; micro-batch "
            f"of {case.micro_batch} answers of {case.answer_tokens} tokens after {step['prompt_positions']}-"
            f"position prompts): a training micro-step {peak['Total']:.2f} GiB (weights "
            f"{peak['Parameter']:.2f}, activations {peak['Activation']:.2f}, temporaries "
            f"{peak.get('Temp', 0.0):.2f}); the pass without gradients {forward['peak_gib']['Total']:.2f}"
        )
        print(
            "on paper, the parts: "
            + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in paper.items())
            + f" GiB ({sum(paper.values()):.2f} in all, activations not counted)"
        )
        report[case.family] = {"micro_step": step, "forward": forward, "on_paper_gib": paper}
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    return report
