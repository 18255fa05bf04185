import torch; torch.set_num_threads(1)
from tiny_ltx2 import make_components
for cm in [(1,), (1, 1), (1, 1, 1)]:
    c = make_components(audio_ch_mult=cm)
    avae = c["audio_vae"]
    z = torch.randn(1, 2, 9, 2)
    with torch.no_grad():
        mel = avae.decode(z).sample
        # encode path: mel [B, 2, T, mel_bins] -> latent
        post = avae.encode(torch.randn(1, 2, 33, 8)).latent_dist
    print(cm, "mel", tuple(mel.shape), "zero frac", float((mel == 0).float().mean()), "| encode(1,2,33,8) ->", tuple(post.mode().shape))
# video VAE encode/decode shapes
vae = c["vae"]
with torch.no_grad():
    x = torch.randn(1, 3, 9, 32, 32)
    z = vae.encode(x).latent_dist.mode(); print("video enc", tuple(x.shape), "->", tuple(z.shape), "dec ->", tuple(vae.decode(z).sample.shape))
    # slicing + tiling
    vae.enable_slicing(); vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=16, tile_sample_stride_width=16)
    zz = torch.randn(2, 4, 5, 8, 8)
    td = vae.decode(zz).sample; vae.disable_tiling(); vae.disable_slicing(); fd = vae.decode(zz).sample
    print("tiled+sliced dec", tuple(td.shape), "vs untiled maxdiff", (td-fd).abs().max().item())
# slicing bug with timestep_conditioning
from diffusers import AutoencoderKLLTX2Video
import tiny_ltx2
torch.manual_seed(0)
v2 = AutoencoderKLLTX2Video(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
    layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
    decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,), upsample_factor=(1,),
    timestep_conditioning=True, patch_size=1, decoder_causal=False)
v2.enable_slicing()
try:
    with torch.no_grad():
        out = v2.decode(torch.randn(3, 4, 3, 8, 8), torch.tensor([0.05]*3)).sample
    print("slicing+temb B=3 ok", out.shape)
except Exception as e:
    print("slicing+temb B=3 FAILS:", type(e).__name__, e)
