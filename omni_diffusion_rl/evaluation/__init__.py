"""Evaluation, never trained on: the held-out set with the training reward and the eval metrics
(heldout.py), what `odrl eval` evaluates (targets.py) and held-out tiny-AVQA accuracy (avqa.py)."""
