import io, contextlib, torch, numpy as np
import tiny_thinker as tt
tok = tt.build_tokenizer(); torch.manual_seed(0)
m = tt.Qwen2_5OmniThinkerForConditionalGeneration(tt.build_config(tok)).eval(); p = tt.build_processor(tok)
rng = np.random.default_rng(0)
conv = [{"role": "user", "content": [{"type": "audio", "audio": rng.standard_normal(16000).astype(np.float32)},
        {"type": "image", "image": (rng.random((60, 90, 3)) * 255).astype(np.uint8)},
        {"type": "video", "video": [(rng.random((56, 56, 3)) * 255).astype(np.uint8) for _ in range(4)]},
        {"type": "text", "text": "hi"}]}]
x = p.apply_chat_template([conv], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
with torch.no_grad():
    ref = m(**x).logits
    enc = {"image": m.get_image_features(x["pixel_values"], x["image_grid_thw"], return_dict=True),
           "video": m.get_video_features(x["pixel_values_videos"], x["video_grid_thw"], return_dict=True)}
    y = {k: v for k, v in x.items() if k not in ("pixel_values", "pixel_values_videos")}
    out = m(**y, mm_encoder_outputs=enc).logits
print("mm_encoder_outputs reuse max diff:", (out - ref).abs().max().item())
