import time, torch
torch.set_num_threads(1)
from tiny_ltx2 import make_pipeline, NO_GUIDANCE
t0 = time.time()
pipe = make_pipeline()
print("build s", round(time.time()-t0, 2))
tok = pipe.tokenizer
print(tok(["a robot dancing"], padding="max_length", max_length=16, truncation=True, return_tensors="pt"))
for name in ["transformer","vae","audio_vae","text_encoder","connectors","vocoder"]:
    m = getattr(pipe, name); print(name, sum(p.numel() for p in m.parameters()))
print("ratios", pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio, pipe.audio_vae_mel_compression_ratio, pipe.audio_vae_temporal_compression_ratio)
t0 = time.time()
out = pipe(prompt="a robot dancing", negative_prompt="", height=32, width=32, num_frames=9, frame_rate=25.0,
           num_inference_steps=2, generator=torch.Generator().manual_seed(0), max_sequence_length=16,
           output_type="pt", **NO_GUIDANCE)
print("run s", round(time.time()-t0, 2))
print("frames", out.frames.shape, out.frames.dtype, float(out.frames.min()), float(out.frames.max()))
print("audio", out.audio.shape, out.audio.dtype, "sr", pipe.vocoder.config.output_sampling_rate)
t0 = time.time()
out = pipe(prompt="a robot dancing", height=32, width=32, num_frames=9, frame_rate=25.0,
           num_inference_steps=2, generator=torch.Generator().manual_seed(0), max_sequence_length=16,
           output_type="np")
print("default-guidance run s", round(time.time()-t0, 2), out.frames.shape, out.audio.shape)
