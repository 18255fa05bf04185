"""The demo world: the tiny text-to-audio-video world and its judge (tiny_world.py, judge.py,
adversarial.py), tiny AVQA (avqa.py), the clip format the tiny models decode into (tiny_clip.py),
and the pre-training of the tiny models on it (pretrain.py, pretrain_omni.py)."""
