import time, torch
from tiny import *
torch.manual_seed(0)
vv=tiny_video_vae()
print("vae ratios", vv.spatial_compression_ratio, vv.temporal_compression_ratio, "tokens_chunk", vv.tokens_chunk_size, "tok_overlap", vv.token_overlap, "frame_overlap", vv.frame_overlap, "pre_pad", vv.frame_pre_padding, "tiling", vv.use_tiling)
with torch.no_grad():
    for F,H,W in [(1,32,32),(5,32,32),(9,32,32),(17,32,32),(22,32,32),(39,32,32),(22,16,16),(22,32,48),(22,20,20)]:
        x=torch.randn(1,3,F,H,W)
        t0=time.time()
        try:
            z=vv.encode(x).latent_dist.mode()
        except Exception as e:
            print(f"video {F}x{H}x{W}: encode ERR {e}"); continue
        try:
            d=vv.decode(z).sample; ds=tuple(d.shape)
        except Exception as e:
            ds=f"decode ERR {e}"
        print(f"video {F}x{H}x{W}: latent {tuple(z.shape)} decode {ds} {time.time()-t0:.2f}s")
    for T in [1,2,3,4,7,12]:
        try: print("decode T",T,"->",tuple(vv.decode(torch.randn(1,4,T,8,8)).sample.shape))
        except Exception as e: print("decode T",T,"ERR",e)
