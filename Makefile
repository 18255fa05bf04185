# The two commands of the README, and the rest of the project's chores.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo demo-sync test test-fast bench bench-modes bench-learning bench-recheck lint pretrain notebook docs clean

$(BIN)/odrl:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first, unless a CUDA device is present (never torchvision/torchaudio).
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/pip install -q "torch>=2.4"; else $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q -e ".[test,imagebind]"
	# ImageBind's model code without its declared torchvision/torchaudio/CUDA dependencies, in a side
	# folder that only the imagebind reward searches: an importable timm without torchvision breaks
	# the `accelerate` command.
	$(BIN)/pip install -q --no-deps --target $(VENV)/imagebind-site imagebind-unofficial==0.1.1 timm==1.0.31

setup: $(BIN)/odrl

demo: setup
	# The demo owns runs/tiny_t2av_nft: running it again starts over there (ARGS: more overrides).
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/odrl train recipes/configs/tiny_t2av_nft.yaml train.overwrite=true $(ARGS)

demo-sync: setup
	# The sync world (docs/sync.md): the tiny sync model learns to sound on its strikes and count them.
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/odrl train recipes/configs/tiny_sync_nft.yaml train.overwrite=true $(ARGS)

# The suite on three workers (pytest-xdist; 2 cores: a third worker computes while tests wait on a
# server, a sleeping reward or a process start; measured 17.8 against 18.8 minutes with two): a test
# file stays on one worker, so its module fixtures are made once. A test still running after 20
# minutes hangs (the longest takes about 3): pytest-timeout stops it. An older .venv gets both plug-ins
# here. The fast tier runs on two (one per core: its tests compute, none waits).
XDIST := -n 3 --dist loadfile --timeout 1200
XDIST_FAST := -n 2 --dist loadfile --timeout 1200
test: setup
	$(BIN)/python -c "import xdist, pytest_timeout" 2>/dev/null || $(BIN)/pip install -q -e ".[test,imagebind]"
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	HF_HUB_OFFLINE=1 WANDB_MODE=offline ODRL_REQUIRE_IMAGEBIND=1 $(BIN)/python -m pytest -q $(XDIST) --durations=40

# The inner loop: the in-process tests of a few training steps; a test that starts a process or
# trains longer is marked slow, and tests/conftest.py fails one that is not.
test-fast: setup
	$(BIN)/python -c "import xdist, pytest_timeout" 2>/dev/null || $(BIN)/pip install -q -e ".[test,imagebind]"
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/python -m pytest -q $(XDIST_FAST) -m "not slow"

bench: setup
	$(BIN)/odrl bench nft-step --output runs/bench/nft_step.json
	HF_HUB_OFFLINE=1 $(BIN)/odrl bench reward-server --output runs/bench/reward_server.json

bench-modes: setup
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/odrl bench modes --output runs/bench/modes.json

bench-learning: setup
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/odrl bench learning --output runs/bench/learning.json

bench-recheck: setup
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/odrl bench recheck --output runs/bench/recheck.json

pretrain: setup
	$(BIN)/odrl pretrain

# The preview notebook, executed headless against the demo's latest checkpoint (`make demo` first):
# the executed copy, with its pictures and audio players, and the previews go to
# runs/tiny_t2av_nft/notebook/.
notebook: setup
	$(BIN)/python -c "import nbclient, nbformat, ipykernel" 2>/dev/null || $(BIN)/pip install -q -e ".[notebook]"
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(BIN)/python -m omni_diffusion_rl.notebook_runner

# The documentation site (mkdocs.yml: docs/ into build/site/), strict: a broken link or anchor, or a
# page missing from the nav, fails it. mkdocs comes with the test extra; an older .venv gets it here.
docs: setup
	$(BIN)/python -c "import mkdocs, material" 2>/dev/null || $(BIN)/pip install -q -e ".[test,imagebind]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf runs $(VENV)
