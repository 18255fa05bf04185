import torch; torch.set_num_threads(1)
from transformers import Gemma3TextConfig, Gemma3ForCausalLM, Gemma3TextModel, T5Config, T5EncoderModel, GemmaConfig, GemmaModel
from diffusers import LTX2Pipeline
from tiny_ltx2 import make_components, NO_GUIDANCE, TEXT_HIDDEN, TEXT_LAYERS
base = make_components()
V = len(base["tokenizer"])
tcfg = dict(vocab_size=V, hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=TEXT_LAYERS, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, pad_token_id=0)
cands = {
    "Gemma3ForCausalLM": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**tcfg, sliding_window=16)),
    "Gemma3TextModel": lambda: Gemma3TextModel(Gemma3TextConfig(**tcfg, sliding_window=16)),
    "GemmaModel": lambda: GemmaModel(GemmaConfig(**tcfg)),
    "T5EncoderModel": lambda: T5EncoderModel(T5Config(vocab_size=V, d_model=TEXT_HIDDEN, d_kv=8, d_ff=32, num_layers=TEXT_LAYERS, num_heads=2)),
}
for name, mk in cands.items():
    c = dict(base); torch.manual_seed(0); c["text_encoder"] = mk().eval()
    p = LTX2Pipeline(**c); p.set_progress_bar_config(disable=True)
    try:
        o = p(prompt="a robot", height=32, width=32, num_frames=9, num_inference_steps=2, max_sequence_length=16, output_type="pt", **NO_GUIDANCE)
        print(name, "OK", tuple(o.frames.shape), tuple(o.audio.shape))
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e)[:150])
# save/load round trip of the whole tiny pipeline (Gemma3ForConditionalGeneration + GemmaTokenizer)
import shutil; shutil.rmtree("/tmp/ltx2_research/tiny_pipe", ignore_errors=True)
p = LTX2Pipeline(**base); p.save_pretrained("/tmp/ltx2_research/tiny_pipe")
q = LTX2Pipeline.from_pretrained("/tmp/ltx2_research/tiny_pipe"); print("save_pretrained/from_pretrained OK:", type(q.text_encoder).__name__, type(q.tokenizer).__name__)
