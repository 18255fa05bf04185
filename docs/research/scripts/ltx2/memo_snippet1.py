import torch; torch.set_num_threads(1)
import string, torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer
from diffusers import (AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
                       LTX2Pipeline, LTX2VideoTransformer3DModel)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

# tokenizer: char-level GemmaTokenizer built in code (no files). In transformers 5, GemmaTokenizerFast is GemmaTokenizer.
specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
chars = list(string.ascii_lowercase + string.digits + ".,!?'-") + ["\u2581"]
tokenizer = GemmaTokenizer(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[])
tokenizer.model_max_length = 64

# text encoder: real class Gemma3ForConditionalGeneration, random weights (needs a tiny vision tower in the config)
text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
    text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                     sliding_window=16, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                       image_size=28, patch_size=14),
    mm_tokens_per_image=4)).eval()

vae = AutoencoderKLLTX2Video(
    in_channels=3, out_channels=3, latent_channels=4,
    block_out_channels=(8,), decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
    spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False),
    downsample_type=("spatiotemporal",),   # diffusers' own test uses ("spatial",): then encode() does not compress time
    upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False,
    patch_size=4, patch_size_t=1,          # spatial ratio = 4*2 = 8, temporal ratio = 2
    encoder_causal=True, decoder_causal=False)

transformer = LTX2VideoTransformer3DModel(
    in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
    num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,             # must equal 2*8
    vae_scale_factors=(2, 8, 8),                                                     # (t, s, s) of the VAE; RoPE only
    audio_in_channels=4, audio_out_channels=4,                                       # = audio latent_ch * mel_bins//4
    audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,  # must equal 2*4
    audio_sampling_rate=16000, audio_hop_length=160, audio_scale_factor=4,
    num_layers=2, caption_channels=16,                                               # = connector output dim
    rope_double_precision=False, rope_type="split")

connectors = LTX2TextConnectors(
    caption_channels=16, text_proj_in_factor=2 + 1,           # text hidden size; num_hidden_layers + 1
    video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
    video_connector_num_learnable_registers=None,
    audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=None,
    connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split")

audio_vae = AutoencoderKLLTX2Audio(
    base_channels=4,                 # must equal latent_channels * (mel_bins // 4); see "surprises"
    output_channels=2, ch_mult=(1, 1, 1),   # needs 3 levels to really upsample 4x (diffusers' test uses (1,))
    num_res_blocks=1, attn_resolutions=None, in_channels=2, resolution=32, latent_channels=2,
    norm_type="pixel", causality_axis="height", dropout=0.0, mid_block_add_attention=False,
    sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)

vocoder = LTX2Vocoder(
    in_channels=2 * 8,               # audio_vae.output_channels * mel_bins
    hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
    resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
    output_sampling_rate=400)        # metadata only: 100 mel frames/s * prod(upsample_factors)

pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae,
                    text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                    transformer=transformer, vocoder=vocoder)

NO_GUIDANCE = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                   modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0,
                   audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None)
out = pipe(prompt="a robot dancing", height=32, width=32, num_frames=9, frame_rate=25.0, num_inference_steps=2,
           max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="pt", **NO_GUIDANCE)
# out.frames: [1, 9, 3, 32, 32] float in [0,1]   (output_type="np": (1, 9, 32, 32, 3))
# out.audio : [1, 2, 132]  stereo waveform; sample rate = pipe.vocoder.config.output_sampling_rate (400 here, 24000 real)
# fps = the frame_rate you passed (25); the pipeline returns no fps

print(out.frames.shape, out.audio.shape)
