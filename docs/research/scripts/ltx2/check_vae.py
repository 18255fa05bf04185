import torch; torch.set_num_threads(1)
from tiny_ltx2 import make_components
for p in (1, 2, 4):
    vae = make_components(vae_patch=p)["vae"]
    with torch.no_grad():
        x = torch.randn(1, 3, 9, 32, 32)
        z = vae.encode(x).latent_dist.mode()
        print("patch", p, "ratios s/t", vae.spatial_compression_ratio, vae.temporal_compression_ratio, "enc", tuple(x.shape), "->", tuple(z.shape), "dec ->", tuple(vae.decode(z).sample.shape), "nparams", sum(q.numel() for q in vae.parameters()))
