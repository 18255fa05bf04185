"""Every test runs offline: no hub downloads, wandb writes local runs only."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
