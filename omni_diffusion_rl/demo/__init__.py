"""The demo world's training and evaluation helpers, outside the core: pre-training the tiny base,
its teacher and the tiny omni model on the world's clips (pretrain.py, pretrain_omni.py), and
held-out tiny-AVQA accuracy (avqa_eval.py)."""
