"""The H3 recipe's ImageBind reward on its device, traced without a GPU: one request of a rank's 16
clips (124 frames at 768 x 1344, 24 fps, stereo 48 kHz audio) in ImageBind's audio-video mode.

The recipe serves CLAP and ImageBind on `cuda:0`, the GPU of training rank 0. Two parts are traced,
each under torch's MemTracker on fake tensors:

- the vision preprocessing (`rewards.imagebind_preprocess.vision_inputs`): the frames ImageBind
  reads (5 two-frame clips a sample) picked where the request's frames are (the server's host
  memory) and moved to the device, resized and cropped there; the request's own frames are not
  counted (they stay in host memory);
- the model's forward (`imagebind_huge`, built by the project's `build_model`, fp32 weights as the
  reward loads them) on inputs of the shapes `ImageBindReward.inputs` makes.

The audio features are computed in host memory and are small (3 clips of 128 x 204 a sample).

CLAP's forward is traced the same way (`laion/clap-htsat-unfused`'s architecture, transformers' default
ClapConfig): its audio tower on the request's clips, padded to its 10 s window, and its text tower.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .memory_tracing import GIB, WholeCallTracker, peak_on


@dataclass(frozen=True)
class RewardCase:
    """One scoring request: a rank's samples at the recipe's clip size; `tiny`: the tests' model."""

    samples: int = 16
    frames: int = 124
    height: int = 768
    width: int = 1344
    fps: float = 24.0
    video_clips: int = 5  # ImageBind's (the reward's default)
    audio_clips: int = 3
    text_tokens: int = 77  # CLAP's RoBERTa tokenizer's limit (a prompt is padded to the longest)
    tiny: bool = False


def _model(case: RewardCase) -> torch.nn.Module:
    from accelerate import init_empty_weights

    from rewards.imagebind import TINY_ARCHITECTURE, build_model

    if case.tiny:
        torch.manual_seed(0)
        return build_model(TINY_ARCHITECTURE)
    with init_empty_weights():  # its constructor reads tensors' values: parameters only on meta
        return build_model("huge")


def trace_imagebind(case: RewardCase, fake: bool = True) -> dict[str, Any]:
    """Peak bytes (GiB, MemTracker's categories) of the vision preprocessing and of the forward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import rewards.imagebind_preprocess as prep

    model = _model(case)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device("cpu"):
        if not case.tiny:
            model.to_empty(device="cpu")
        video = torch.rand(case.samples, case.frames, 3, case.height, case.width)
        frame_bytes = video.numel() * video.element_size()
        preprocess = WholeCallTracker()
        with preprocess, torch.no_grad():
            vision = prep.vision_inputs(video, case.fps, case.video_clips, 2, 1)
        audio = torch.randn(case.samples, case.audio_clips, 1, prep.NUM_MEL_BINS, prep.TARGET_FRAMES)
        forward = WholeCallTracker()
        forward.track_external(model)
        with forward, torch.no_grad():
            model({"vision": vision, "audio": audio})
        pre, fwd = (peak_on(t.get_tracker_snapshot("peak")) for t in (preprocess, forward))
    return {
        "case": asdict(case),
        "fake_tensors": fake,
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "request_frames_gib": frame_bytes / GIB,
        # the tracker counts the request's frames the first time an op reads them: taken out
        "preprocess_gib": (pre["Total"] - frame_bytes) / GIB,
        "forward_gib": {str(k): v / GIB for k, v in fwd.items()},
    }


def _clap(case: RewardCase) -> tuple[Any, Any]:
    """CLAP's model (on meta at full size: `laion/clap-htsat-unfused`'s architecture, transformers'
    default ClapConfig, fp32 as the reward loads it) and its feature extractor; `tiny`: the tests'."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

    from rewards.tiny_models import tiny_clap_parts

    if case.tiny:
        model, processor = tiny_clap_parts()
        return model, processor.feature_extractor
    with torch.device("meta"):
        return ClapModel(ClapConfig()).eval(), ClapFeatureExtractor()


def trace_clap(case: RewardCase, fake: bool = True) -> dict[str, Any]:
    """Peak bytes (GiB, MemTracker's categories) of CLAP's forward on one request, as ClapReward.embed
    calls it: the audio tower on the request's clips (mono, padded to the model's window: the
    features `clap_input_features` makes in host memory) and the text tower on `text_tokens`
    tokens a prompt (the tokenizer's limit at full size)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rewards.clap_features import clap_input_features

    model, extractor = _clap(case)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device("cpu"):
        if not case.tiny:
            model.to_empty(device="cpu")
        mono = torch.zeros(case.samples, int(extractor.nb_max_samples))
        features = clap_input_features(mono, extractor, fusion=False)
        is_longer = torch.zeros(case.samples, 1, dtype=torch.bool)
        tokens = torch.ones(case.samples, case.text_tokens, dtype=torch.long)
        forward = WholeCallTracker()
        forward.track_external(model)
        with forward, torch.no_grad():
            model.get_audio_features(input_features=features, is_longer=is_longer)
            model.get_text_features(input_ids=tokens, attention_mask=torch.ones_like(tokens))
        peak = peak_on(forward.get_tracker_snapshot("peak"))
    return {
        "case": asdict(case),
        "fake_tensors": fake,
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "features_gib": features.numel() * features.element_size() / GIB,
        "forward_gib": {str(k): v / GIB for k, v in peak.items()},
    }


def run_reward_trace(output: Path) -> dict[str, Any]:
    """Trace the recipe's request, print what its device holds, write JSON."""
    result = trace_imagebind(RewardCase())
    forward = result["forward_gib"]
    clap = trace_clap(RewardCase())
    clap_gib, clap_own = (
        clap["forward_gib"]["Parameter"],
        clap["forward_gib"]["Total"] - clap["forward_gib"]["Parameter"],
    )
    # Both models stay on the device; the server scores with one at a time.
    working = max(result["preprocess_gib"], forward["Total"] - forward["Parameter"], clap_own)
    result |= {
        "clap": clap,
        "clap_weights_gib": clap_gib,
        "device_peak_gib": forward["Parameter"] + clap_gib + working,
    }
    print(
        f"the reward device (cuda:0 in the H3 recipe) per request of {result['case']['samples']} clips: "
        f"ImageBind's weights {forward['Parameter']:.2f} GiB, its forward {forward['Total']:.2f}, the "
        f"frames it reads {result['preprocess_gib']:.2f} (of the request's "
        f"{result['request_frames_gib']:.2f}, kept in host memory), CLAP's weights {clap_gib:.2f} and its "
        f"forward {clap['forward_gib']['Total']:.2f}: about {result['device_peak_gib']:.1f} GiB"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2))
    return result
