"""Tiny random-init Qwen2.5-Omni *thinker*, fully offline on CPU (transformers 5.24, no torchvision/torchaudio).

Shows: tiny config, offline processor (BPE tokenizer + WhisperFeatureExtractor + Qwen2VLImageProcessorPil +
video-from-frames without the torchvision video processor), chat template, forward with audio+image+video,
sampling with generate + teacher-forced log-prob recompute (GSPO), save/load round trips, LoRA via peft.

Run:  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python docs/research/scripts/qwen_omni/tiny_thinker.py
"""

import os
import shutil
import tempfile
import time

T0 = time.time()

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

from transformers import (
    AutoModel,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    WhisperFeatureExtractor,
)
from transformers.feature_extraction_utils import BatchFeature
from transformers.processing_utils import ProcessorMixin

torch.set_num_threads(1)


def log(*a):
    print(f"[{time.time() - T0:5.1f}s]", *a, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# 1. Tokenizer: tiny byte-level BPE trained in memory + the named multimodal special tokens the processor needs.
# ----------------------------------------------------------------------------------------------------------------
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
            "<|IMAGE|>", "<|VIDEO|>", "<|vision_bos|>", "<|vision_eos|>"]

# Same structure as the official Qwen2.5-Omni chat_template (system default, <|vision_bos|><|IMAGE|><|vision_eos|>, ...)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' %}<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size=400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["You are a helpful assistant.", "system user assistant", "What is in the image? The answer is 42.",
              "Describe the audio and the video. 0 1 2 3 4 5 6 7 8 9"] * 20
    tk.train_from_iterator(corpus, trainer)
    # kwargs ending in `_token` become named "model specific" special tokens -> tok.image_token / tok.image_token_id
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side="left",
        audio_token="<|AUDIO|>", audio_bos_token="<|audio_bos|>", audio_eos_token="<|audio_eos|>",
        image_token="<|IMAGE|>", video_token="<|VIDEO|>",
        vision_bos_token="<|vision_bos|>", vision_eos_token="<|vision_eos|>",
        chat_template=CHAT_TEMPLATE,
    )


# ----------------------------------------------------------------------------------------------------------------
# 2. Tiny thinker config. Constraints: audio.output_dim == vision.out_hidden_size == text.hidden_size;
#    sum(mrope_section) == text head_dim/2; vision head_dim % 4 == 0; token ids must be the tokenizer's ids.
# ----------------------------------------------------------------------------------------------------------------
def build_config(tok):
    ids = tok.convert_tokens_to_ids
    H = 64  # text hidden; head_dim = 64/4 = 16 -> mrope_section sums to 8
    return Qwen2_5OmniThinkerConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=H, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            tie_word_embeddings=False, eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>"),
        ),
        audio_config=dict(
            num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
            output_dim=H, n_window=50, max_source_positions=1500,
        ),
        vision_config=dict(
            depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=H,
            fullatt_block_indexes=[0],
        ),
        audio_token_index=ids("<|AUDIO|>"), image_token_index=ids("<|IMAGE|>"), video_token_index=ids("<|VIDEO|>"),
        audio_start_token_id=ids("<|audio_bos|>"), audio_end_token_id=ids("<|audio_eos|>"),
        # NOT a declared field of Qwen2_5OmniThinkerConfig, but get_rope_index reads config.vision_start_token_id:
        vision_start_token_id=ids("<|vision_bos|>"), vision_end_token_id=ids("<|vision_eos|>"),
        user_token_id=ids("user") if ids("user") != tok.unk_token_id else 0,
        position_id_per_seconds=25, seconds_per_chunk=2,
    )


# ----------------------------------------------------------------------------------------------------------------
# 3. Processor without torchvision. Qwen2_5OmniProcessor.__init__ requires a VideoProcessorMixin and the class
#    lookup itself crashes without torchvision (VIDEO_PROCESSOR_MAPPING is a dummy). Subclass with an __init__
#    that has no `video_processor` arg (ProcessorMixin.get_attributes() reads the __init__ signature) and build
#    pixel_values_videos/video_grid_thw from frames with the PIL image processor (temporal_patch_size=1 per frame,
#    then group `temporal_patch_size` frames per patch -> identical layout to Qwen2VLVideoProcessor.patchify).
# ----------------------------------------------------------------------------------------------------------------
def _flatten_videos(videos):
    """Accepts a video (T,H,W,3 array or list of frames), a list of videos, or a batch-nested list of videos."""
    def is_frame(x):
        return hasattr(x, "size") and not isinstance(x, (list, tuple)) and np.asarray(x).ndim == 3
    if isinstance(videos, np.ndarray) and videos.ndim == 4 or (isinstance(videos, (list, tuple)) and videos and is_frame(videos[0])):
        return [videos]
    out = []
    for v in videos:
        out.extend(_flatten_videos(v))
    return out


def frames_to_video_inputs(image_processor, videos, fps=2.0):
    """videos: list of videos, each a list/array of T frames (H,W,3 uint8). Returns pixel_values_videos,
    video_grid_thw, video_second_per_grid exactly like the video processor would (same resize for all frames)."""
    tps = image_processor.temporal_patch_size
    C, p = 3, image_processor.patch_size
    all_patches, grids = [], []
    for frames in _flatten_videos(videos):
        frames = list(frames)
        if pad := -len(frames) % tps:  # pad with last frame like Qwen2VLVideoProcessor.patchify
            frames += [frames[-1]] * pad
        out = image_processor(images=frames, temporal_patch_size=1, return_tensors="np")
        thw = out["image_grid_thw"]
        assert (thw == thw[0]).all(), "all frames of a video must have the same size"
        _, gh, gw = thw[0]
        n = gh * gw
        pv = out["pixel_values"].reshape(len(frames) // tps, tps, n, C, p * p)  # (gt, tps, tokens, C, p*p)
        pv = pv.transpose(0, 2, 3, 1, 4).reshape(len(frames) // tps * n, C * tps * p * p)
        all_patches.append(pv)
        grids.append([len(frames) // tps, gh, gw])
    return {
        "pixel_values_videos": torch.from_numpy(np.concatenate(all_patches)),
        "video_grid_thw": torch.tensor(grids, dtype=torch.long),
        "video_second_per_grid": torch.tensor([tps / fps] * len(grids)),
    }


class TinyOmniProcessor(Qwen2_5OmniProcessor):
    def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
        ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
        for name in ("image", "audio", "video"):
            setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))
            setattr(self, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
        for name in ("vision_bos", "vision_eos", "audio_bos", "audio_eos"):
            setattr(self, f"{name}_token", getattr(tokenizer, f"{name}_token"))

    @property
    def video_processor(self):  # only used for .merge_size / hasattr(self, "video_processor"); not saved
        return self.image_processor

    def _process_videos(self, videos, audio=None, processed_audio=None, video_to_audio_indices=None, **kwargs):
        fps = kwargs["videos_kwargs"].get("fps") or 2.0
        processed = frames_to_video_inputs(self.image_processor, videos, fps=fps)
        reps = [self.replace_video_token(processed, video_idx=i, processed_audio=processed_audio,
                                         video_to_audio_indices=video_to_audio_indices, **kwargs)
                for i in range(len(processed["video_grid_thw"]))]
        return processed, reps

    @property
    def model_input_names(self):
        return list(dict.fromkeys(self.tokenizer.model_input_names + self.feature_extractor.model_input_names
                                  + self.image_processor.model_input_names + ["feature_attention_mask"]
                                  + ["pixel_values_videos", "video_grid_thw", "video_second_per_grid"]))


def build_processor(tok):
    # chunk_length=2 -> features padded to 200 frames (2 s) instead of 3000 (30 s): much cheaper audio tower.
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160, n_fft=400, chunk_length=2)
    ip = Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2,
                                  size={"shortest_edge": 56 * 56, "longest_edge": 56 * 56 * 4})
    return TinyOmniProcessor(image_processor=ip, feature_extractor=fe, tokenizer=tok, chat_template=CHAT_TEMPLATE)


MM_KEYS = ("input_features", "feature_attention_mask", "pixel_values", "image_grid_thw",
           "pixel_values_videos", "video_grid_thw", "video_second_per_grid")


def completion_mask(completion, eos_id):
    """1 up to and including the first EOS, 0 after (generate pads finished rows with pad_token_id)."""
    is_eos = completion == eos_id
    after = (is_eos.cumsum(1) - is_eos.long()) > 0
    return (~after).long()


def seq_logprobs(model, seqs, attn, mm, prompt_len):
    """Teacher-forced log-probs of seqs[:, prompt_len:] (fp32). mm = the processor's multimodal tensors."""
    out = model(input_ids=seqs, attention_mask=attn, use_cache=False, **mm)
    logits = out.logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)


def main():
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    tok = build_tokenizer()
    cfg = build_config(tok)
    model = Qwen2_5OmniThinkerForConditionalGeneration(cfg).eval()  # fp32 on CPU, sdpa attention by default
    with torch.no_grad():  # make EOS likely enough that some rows finish early (tests the completion mask path)
        model.lm_head.weight[tok.eos_token_id] *= 14.0
    proc = build_processor(tok)
    log(f"built tokenizer (|V|={len(tok)}), model ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params), processor")

    # ---------------------------------------------------------------- inputs
    audio = rng.standard_normal(16000).astype(np.float32) * 0.1  # 1 s @16 kHz -> 100 frames -> 25 audio tokens
    image = (rng.random((60, 90, 3)) * 255).astype(np.uint8)
    video = [(rng.random((56, 56, 3)) * 255).astype(np.uint8) for _ in range(4)]  # 4 frames -> grid_t = 2
    conv_a = [{"role": "user", "content": [
        {"type": "audio", "audio": audio}, {"type": "image", "image": image}, {"type": "video", "video": video},
        {"type": "text", "text": "Describe the audio and the video."}]}]
    conv_b = [{"role": "user", "content": [
        {"type": "audio", "audio": audio[:8000]}, {"type": "image", "image": image[:40, :40]},
        {"type": "video", "video": video[:2]}, {"type": "text", "text": "What is in the image? Answer with a long explanation please."}]}]
    text = proc.apply_chat_template([conv_a, conv_b], add_generation_prompt=True, tokenize=False)
    log("chat template ->", repr(text[0][:160]))
    inputs = proc.apply_chat_template([conv_a, conv_b], add_generation_prompt=True, tokenize=True, processor_kwargs={"padding": True},
                                      return_dict=True, return_tensors="pt")
    log("processor keys/shapes:", {k: tuple(v.shape) for k, v in inputs.items()})
    log("video_grid_thw", inputs["video_grid_thw"].tolist(), "image_grid_thw", inputs["image_grid_thw"].tolist())

    # check: our frame->video patches equal a straight port of Qwen2VLVideoProcessor.patchify on normalized frames
    ip = proc.image_processor
    mean, std = np.array(ip.image_mean), np.array(ip.image_std)
    fr = np.stack([((f.astype(np.float32) / 255 - mean) / std).transpose(2, 0, 1) for f in video])  # 56x56: no resize
    vt = torch.from_numpy(fr).float()[None]  # (1, T, C, H, W)
    B, T, C, Hh, Ww = vt.shape
    gt, gh, gw, m, p = T // 2, Hh // 14, Ww // 14, 2, 14
    ref = vt.view(B, gt, 2, C, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(gt * gh * gw, -1)
    ours = frames_to_video_inputs(ip, [video])["pixel_values_videos"]
    log(f"frames->pixel_values_videos vs video-processor patchify layout: max|diff|={(ours - ref).abs().max():.2e}")

    # ---------------------------------------------------------------- 3a. forward
    mm = {k: inputs[k] for k in MM_KEYS if k in inputs}
    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    log("forward logits", tuple(out.logits.shape), "finite:", bool(torch.isfinite(out.logits).all()))

    # ---------------------------------------------------------------- 3b. generate + recompute (GSPO-style)
    prompt_len = inputs["input_ids"].shape[1]
    # A random model happily samples <|IMAGE|>/<|AUDIO|>/... ids; a sampled placeholder breaks the recompute
    # ("Image features and image tokens do not match"). Suppress all special ids except EOS during sampling.
    suppress = [tok.convert_tokens_to_ids(t) for t in SPECIALS if t != "<|im_end|>"]
    torch.manual_seed(1)
    with torch.no_grad():
        gen = model.generate(**inputs, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12,
                             suppress_tokens=suppress, return_dict_in_generate=True, output_logits=True,
                             pad_token_id=tok.pad_token_id)
    seqs = gen.sequences
    gen_lp = torch.stack([torch.log_softmax(l.float(), -1) for l in gen.logits], 1)  # raw logits per step
    gen_lp = gen_lp.gather(-1, seqs[:, prompt_len:, None]).squeeze(-1)
    comp_mask = completion_mask(seqs[:, prompt_len:], tok.eos_token_id)
    attn = torch.cat([inputs["attention_mask"], comp_mask], 1)
    with torch.no_grad():
        rec_lp = seq_logprobs(model, seqs, attn, mm, prompt_len)
        rec_nomm = seq_logprobs(model, seqs, attn, {k: v for k, v in mm.items()
                                                    if k in ("image_grid_thw", "video_grid_thw", "feature_attention_mask",
                                                             "video_second_per_grid")}, prompt_len)
        # RL trainers often pass their own 2D position_ids = cumsum(mask)-1: that silently disables 3D mrope
        pos2d = (attn.cumsum(1) - 1).clamp(min=0)
        out2d = model(input_ids=seqs, attention_mask=attn, position_ids=pos2d, use_cache=False, **mm)
        rec_pos2d = torch.log_softmax(out2d.logits[:, prompt_len - 1:-1].float(), -1).gather(
            -1, seqs[:, prompt_len:, None]).squeeze(-1)
    log(f"generated {comp_mask.sum(1).tolist()} tokens/sample; left-pad per row:",
        (inputs['attention_mask'] == 0).sum(1).tolist())
    log(f"GSPO check: max|logp_gen - logp_recompute| = {((gen_lp - rec_lp).abs() * comp_mask).max():.3e}  (fp32, target < 1e-4)")
    log(f"  recompute WITHOUT pixel_values/input_features: max diff = {((gen_lp - rec_nomm).abs() * comp_mask).max():.3e}")
    log(f"  recompute with 2D position_ids (no 3D mrope):   max diff = {((gen_lp - rec_pos2d).abs() * comp_mask).max():.3e}")

    # num_return_sequences > 1 (group sampling)
    torch.manual_seed(2)
    with torch.no_grad():
        g2 = model.generate(**inputs, do_sample=True, top_k=0, max_new_tokens=6, suppress_tokens=suppress,
                            num_return_sequences=2, return_dict_in_generate=True, output_logits=True,
                            pad_token_id=tok.pad_token_id)
        s2 = g2.sequences
        lp2 = torch.stack([torch.log_softmax(l.float(), -1) for l in g2.logits], 1)
        lp2 = lp2.gather(-1, s2[:, prompt_len:, None]).squeeze(-1)
        # expand processor outputs per sample yourself for the recompute (pixel_values are flat patches!)
        exp = proc.apply_chat_template([conv_a, conv_a, conv_b, conv_b], add_generation_prompt=True, tokenize=True, processor_kwargs={"padding": True},
                                       return_dict=True, return_tensors="pt")
        assert torch.equal(exp["input_ids"], s2[:, :prompt_len])
        cm2 = completion_mask(s2[:, prompt_len:], tok.eos_token_id)
        a2 = torch.cat([exp["attention_mask"], cm2], 1)
        r2 = seq_logprobs(model, s2, a2, {k: exp[k] for k in MM_KEYS if k in exp}, prompt_len)
    log(f"num_return_sequences=2: max|diff| = {((lp2 - r2).abs() * cm2).max():.3e}")

    # video passed as a list of images instead (each frame = own <|IMAGE|> block, grid t=1, frame duplicated x2)
    conv_c = [{"role": "user", "content": [*({"type": "image", "image": f} for f in video),
                                           {"type": "text", "text": "video as images"}]}]
    ic = proc.apply_chat_template([conv_c], add_generation_prompt=True, tokenize=True, processor_kwargs={"padding": True}, return_dict=True,
                                  return_tensors="pt")
    with torch.no_grad():
        oc = model(**ic)
    log("video-as-images: image_grid_thw", ic["image_grid_thw"].tolist(), "logits", tuple(oc.logits.shape))

    # ---------------------------------------------------------------- save / load round trip
    d = tempfile.mkdtemp(prefix="tiny_omni_", dir=None)
    model.save_pretrained(d)
    proc.save_pretrained(d)
    log("saved files:", sorted(os.listdir(d)))
    m2 = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    m3 = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32).eval()
    base = AutoModel.from_pretrained(d, dtype=torch.float32)
    p2 = TinyOmniProcessor.from_pretrained(d)
    tok2 = AutoTokenizer.from_pretrained(d)
    i2 = p2.apply_chat_template([conv_a, conv_b], add_generation_prompt=True, tokenize=True, processor_kwargs={"padding": True}, return_dict=True,
                                return_tensors="pt")
    with torch.no_grad():
        o2, o3 = m2(**i2).logits, m3(**i2).logits
    log(f"reload: {type(m3).__name__} / AutoModel->{type(base).__name__}; same ids: {torch.equal(i2['input_ids'], inputs['input_ids'])};"
        f" max|logit diff| {(o2 - out.logits).abs().max():.1e} {(o3 - out.logits).abs().max():.1e};"
        f" tok2.image_token_id={tok2.image_token_id}")

    # ---------------------------------------------------------------- LoRA on the language model only
    from peft import LoraConfig, PeftModel, get_peft_model

    lcfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,  # non-zero init to test save/load
                      target_modules=r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)")
    pm = get_peft_model(m2, lcfg)
    names = [n for n, mod in pm.named_modules() if hasattr(mod, "lora_A")]
    assert names and all("language_model" in n for n in names), names
    log(f"LoRA wrapped {len(names)} modules, e.g. {names[0]}; trainable params:",
        sum(p.numel() for p in pm.parameters() if p.requires_grad))
    # one GSPO-like gradient step through the recompute
    pm.train()
    lp = seq_logprobs(pm, seqs, attn, mm, prompt_len)
    (-lp.mean()).backward()
    gn = [p.grad.norm().item() for n, p in pm.named_parameters() if p.requires_grad and p.grad is not None]
    log(f"backward ok, {len(gn)} LoRA grads, vision/audio grads: "
        f"{sum(p.grad is not None for n, p in pm.named_parameters() if 'visual' in n or 'audio_tower' in n)}")
    pm.eval()
    with torch.no_grad():
        lo = pm(**inputs).logits
    ad = os.path.join(d, "adapter")
    pm.save_pretrained(ad)
    log("adapter files:", sorted(os.listdir(ad)))
    fresh = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(d, dtype=torch.float32)
    pm2 = PeftModel.from_pretrained(fresh, ad).eval()
    with torch.no_grad():
        lo2 = pm2(**inputs).logits
        merged = pm2.merge_and_unload()
        lo3 = merged(**inputs).logits
    log(f"adapter reload max|diff| {(lo - lo2).abs().max():.1e}; merged max|diff| {(lo - lo3).abs().max():.1e}; "
        f"lora changed logits by {(lo - out.logits).abs().max():.2e}")
    shutil.rmtree(d)
    log("DONE")


if __name__ == "__main__":
    main()
