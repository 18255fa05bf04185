"""Recipe entry point for `accelerate launch`.

accelerate launch recipes/train_nft.py recipes/configs/tiny_t2av_nft.yaml train.steps=10
ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 recipes/train_nft.py CONFIG
"""

import sys

from omni_diffusion_rl.runtime.lifeline import exit_with_parent  # first: it records the launcher's pid

if __name__ == "__main__":
    exit_with_parent()  # a killed launcher takes this process down (a run started from a shell: never)
    from omni_diffusion_rl.cli import entry

    sys.exit(entry(["train", *sys.argv[1:]]))
