"""Brief check: same recipe for Qwen3OmniMoeThinkerForConditionalGeneration (tiny MoE)."""
import time, numpy as np, torch
import tiny_thinker as tt
from transformers import (Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration, Qwen3OmniMoeProcessor,
                          Qwen2VLImageProcessorPil, WhisperFeatureExtractor)
from transformers.processing_utils import ProcessorMixin
torch.set_num_threads(1); t0 = time.time()

class TinyQwen3OmniProcessor(Qwen3OmniMoeProcessor):  # same trick: no video_processor in __init__
    __init__ = tt.TinyOmniProcessor.__init__
    video_processor = tt.TinyOmniProcessor.video_processor
    _process_videos = tt.TinyOmniProcessor._process_videos
    model_input_names = tt.TinyOmniProcessor.model_input_names

tok = tt.build_tokenizer(); ids = tok.convert_tokens_to_ids; H = 64
cfg = Qwen3OmniMoeThinkerConfig(
    text_config=dict(vocab_size=len(tok), hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                     decoder_sparse_step=1, max_position_embeddings=4096,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                     eos_token_id=ids("<|im_end|>"), pad_token_id=ids("<|endoftext|>")),
    audio_config=dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                      output_dim=H, n_window=50, n_window_infer=100, downsample_hidden_size=16, max_source_positions=1500),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                       temporal_patch_size=2, out_hidden_size=H, num_position_embeddings=64, deepstack_visual_indexes=[0]),
    audio_token_id=ids("<|AUDIO|>"), image_token_id=ids("<|IMAGE|>"), video_token_id=ids("<|VIDEO|>"),
    audio_start_token_id=ids("<|audio_bos|>"), audio_end_token_id=ids("<|audio_eos|>"),
    vision_start_token_id=ids("<|vision_bos|>"), vision_end_token_id=ids("<|vision_eos|>"), user_token_id=0,
)
torch.manual_seed(0)
model = Qwen3OmniMoeThinkerForConditionalGeneration(cfg).eval()
fe = WhisperFeatureExtractor(feature_size=128, chunk_length=2)
ip = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 64 * 64, "longest_edge": 64 * 64 * 4})
proc = TinyQwen3OmniProcessor(image_processor=ip, feature_extractor=fe, tokenizer=tok, chat_template=tt.CHAT_TEMPLATE)
rng = np.random.default_rng(0)
audio = rng.standard_normal(16000).astype(np.float32) * .1
img = (rng.random((64, 96, 3)) * 255).astype(np.uint8)
vid = [(rng.random((64, 64, 3)) * 255).astype(np.uint8) for _ in range(4)]
conv = lambda n: [{"role": "user", "content": [{"type": "audio", "audio": audio[:n]}, {"type": "image", "image": img},
                  {"type": "video", "video": vid}, {"type": "text", "text": "Describe" * (1 + n // 8000)}]}]
inputs = proc.apply_chat_template([conv(16000), conv(8000)], add_generation_prompt=True, tokenize=True,
                                  processor_kwargs={"padding": True}, return_dict=True, return_tensors="pt")
print({k: tuple(v.shape) for k, v in inputs.items()})
P = inputs["input_ids"].shape[1]
sup = [ids(t) for t in tt.SPECIALS if t != "<|im_end|>"]
torch.manual_seed(1)
with torch.no_grad():
    g = model.generate(**inputs, do_sample=True, top_k=0, max_new_tokens=8, suppress_tokens=sup,
                       return_dict_in_generate=True, output_logits=True, pad_token_id=tok.pad_token_id)
    s = g.sequences
    glp = torch.stack([torch.log_softmax(l.float(), -1) for l in g.logits], 1).gather(-1, s[:, P:, None]).squeeze(-1)
    cm = tt.completion_mask(s[:, P:], tok.eos_token_id)
    mm = {k: inputs[k] for k in tt.MM_KEYS if k in inputs}
    rlp = tt.seq_logprobs(model, s, torch.cat([inputs["attention_mask"], cm], 1), mm, P)
print(f"qwen3-omni-moe tiny: {sum(p.numel() for p in model.parameters())/1e6:.2f}M params; "
      f"max|logp diff| = {((glp - rlp).abs() * cm).max():.3e}; {time.time() - t0:.1f}s")
lin = sorted({n.split('.')[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and 'language_model' in n})
print("LM Linear leaf names:", lin, "| expert params:", [n for n, _ in model.named_parameters() if 'layers.0.mlp' in n])
import copy
from peft import LoraConfig, get_peft_model
R = r".*language_model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj"
EXP = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # fused 3D expert params (not nn.Linear) -> target_parameters
for kw in [dict(target_modules=R, target_parameters=EXP),  # peft MoE conversion rewrites regex -> leaf names: hits audio_tower!
           dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], exclude_modules=r".*(visual|audio_tower).*",
                target_parameters=EXP)]:
    pm = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, **kw))
    tr = sorted({n.split(".lora_")[0].replace("base_model.model.model.", "") for n, p in pm.named_parameters() if p.requires_grad})
    print("LoRA", {k: (v if isinstance(v, str) else sorted(v)) for k, v in kw.items()}, "->", len(tr), "targets; outside LM:",
          [t for t in tr if "language_model" not in t])
with torch.no_grad():
    print("peft(qwen3) forward ok:", tuple(pm(**inputs).logits.shape))
