"""Every built-in algorithm's options and config checks, importing neither torch nor any trainer.

Loading a config reads an algorithm's options dataclass (its keys sit flat in the algorithm section)
and runs its checks; for the built-in algorithms both are here, so `load_config` imports no trainer,
model or peft. The trainers take their `options_type` from here. A plug-in algorithm declares its
options on its class (`options_type`, `check`): `algorithm_card` reads them from the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config_fields import NO_TEACHER, ConfigError, check_registered_name, option

if TYPE_CHECKING:
    from .config import ExperimentConfig

# The choices of the options below; the math and the trainers import them from here.
CREDITS = ("global", "per_modality")
BALANCES = ("equal", "entries")
ADV_MODES = ("continuous", "positive_only", "negative_only", "one_only", "binary")
STD_CORRECTIONS = {"population": 0, "sample": 1}
"""algorithm.adv_std: the std advantages divide by, without (ddof 0) or with Bessel's correction (trl)."""
DECAY_SCHEDULES = ("copy", "linear_to_0_5", "delayed_linear_to_0_999")
TIMESTEP_CHOICES = ("random", "noisiest", "noisiest_then_random")
STATE_KINDS = ("visited", "noised")  # where the teacher gives targets (algorithm.distill_states)
DISTILL_TARGETS = ("velocity", "endpoint", "completion", "contrast")
"""algorithm.distill_target: what the student's velocity at a state is trained toward."""
DISTILL_WEIGHTINGS = ("uniform", "step", "x0", "sde_kl")
"""algorithm.distill_weighting: the weight of the state at each sampler time (`state_weights`)."""
SDE_SOLVERS = ("euler",)
"""The solvers whose steps have an SDE form (Flow-GRPO's sampler steps like Euler)."""
AWM_WEIGHTINGS = ("ghuber", "uniform")
AWM_TIME_SAMPLINGS = ("discrete_wo_init", "discrete")
RATIO_LEVELS = ("sequence", "token")
ANSWER_BACKENDS = ("hf", "vllm")  # what samples the rollout answers (algorithm.rollout_backend)
VLLM_REFUSED_FAMILIES = ("qwen2_5_omni", "qwen3_omni")
"""Answering families vLLM cannot sample: their prompts carry positions of their own (3D rope), and
vLLM's prompt embeddings take plain ones."""


# ---------------------------------------------------------------------------------------------
# The options, one dataclass per algorithm


@dataclass
class CreditOptions:
    """How an update assigns credit (algorithm.credit, algorithm.credit_balance)."""

    credit: str = option(
        "global",
        "global (one advantage a sample, from the combined reward) | per_modality (OmniNFT's routing: "
        "each modality's advantage from the rewards that judge it, applied to its entries of the latent)",
        choices=CREDITS,
    )
    credit_balance: str = option(
        "equal",
        "per_modality: the modalities' losses combined as their mean (equal, OmniNFT's) or weighted by "
        "their shares of the latent's entries (entries, as one global advantage weighs them)",
        choices=BALANCES,
    )


@dataclass
class NFTOptions(CreditOptions):
    """DiffusionNFT's options (algorithm.name=nft), flat in the algorithm section."""

    beta: float = option(1.0, "NFT implicit-policy strength (1.0 single reward, 0.1 multi-reward)", gt=0)
    adv_clip_max: float = option(5.0, "advantage clip before the map to r in [0, 1]", gt=0)
    adv_mode: str = option("continuous", "how clipped advantages become r", choices=ADV_MODES)
    per_group_std: bool = option(False, "normalise by each group's std instead of the batch std")
    adv_per_reward: bool = option(
        False,
        "normalise each reward within its groups on its own, then sum them with their weights, so a "
        "reward with a small spread (the shape) ranks samples as much as the others (GDPO)",
    )
    kl_coef: float = option(
        0.5,
        "weight of mean ||v_theta - v_ref||^2 (keeps the picture's quality and variety; 0 skips the "
        "reference forward)",
        ge=0,
    )
    decay_schedule: str = option("linear_to_0_5", "soft update of `old`", choices=DECAY_SCHEDULES)
    timestep_choice: str = option(
        "random",
        "which timesteps are trained: random (timestep_fraction of the grid, drawn per sample) | noisiest "
        "(the noisiest timestep_fraction, where the layout and the shape are decided; the clean end is "
        "never trained) | noisiest_then_random (noisiest in the first half of train.steps, random after)",
        choices=TIMESTEP_CHOICES,
    )
    rollout_sde_noise: float = option(
        0.0,
        "rollouts sample with Flow-GRPO's SDE at this noise level a (sigma_t = a sqrt(t / (1 - t)); 0.7 is "
        "flow_grpo's) instead of the ODE, for more varied groups: NFT trains on any sampler's x0; 0: the "
        "ODE of sampling.solver (evaluation always samples the ODE)",
        ge=0,
    )


@dataclass
class DistillOwnOptions:
    """On-policy distillation's own options."""

    distill_states: str = option(
        "visited",
        "where the teacher gives targets: visited (the states the student's sampler passed) | noised "
        "(the student's x0 forward-noised to each grid time)",
        choices=STATE_KINDS,
    )
    distill_target: str = option(
        "velocity",
        "what the student's velocity at a state is trained toward: velocity (the teacher's, at that "
        "state) | endpoint (the straight line from the state to the teacher's own sample from the "
        "student's starting noise; with distill_states=noised the states are that sample forward-noised: "
        "flow matching on the teacher's samples) | completion (the straight line from the state to the "
        "teacher's own Euler completion from it, at distill_completions visited states per sample) | "
        "contrast (no velocity targets: DiffusionNFT's loss with the teacher's completion from the "
        "visited state at distill_contrast_from as the positive and the student's own sample as the "
        "negative)",
        choices=DISTILL_TARGETS,
    )
    distill_contrast_from: float = option(
        0.8,
        "contrast: the grid time of the visited state the teacher completes each sample from (the "
        "nearest one; 1: the teacher's own sample from the student's noise)",
        gt=0,
        le=1,
    )
    distill_completions: int = option(
        3,
        "completion targets: visited states per sample the teacher completes and the student trains "
        "on (each costs the teacher the grid steps left from it)",
        ge=1,
    )
    distill_weighting: str = option(
        "uniform",
        "weight per state, scaled to mean 1 over the grid: uniform | step (dt_k^2, the transition-mean "
        "form) | x0 (t_k^2: the x0 predictions matched, the noisy states weigh most) | sde_kl (the KL of "
        "the two samplers' Gaussian SDE steps: the clean end weighs most)",
        choices=DISTILL_WEIGHTINGS,
    )
    distill_focus: float = option(
        0.0,
        "weight each latent entry by (its |v_student - v_teacher| / the sample's mean)^focus, detached, "
        "mean 1 per sample: more loss where the teacher disagrees most (a shape's corners); 0: off",
        ge=0,
    )
    nft_coef: float = option(
        0.0,
        "add this times the DiffusionNFT loss (reward and teacher in one run); 0: distillation alone",
        ge=0,
    )
    distill_cond_coef: float = option(
        0.0,
        "velocity targets: add this times the squared gap of the conditional directions, "
        "(v_s(prompt) - v_s(empty)) - (v_T(prompt) - v_T(empty)) at the same states: what the prompt "
        "changes, with the part no prompt decides (the layout) cancelled; the teacher also answers for "
        "the empty prompt; 0: off",
        ge=0,
    )


@dataclass
class DistillOptions(NFTOptions, DistillOwnOptions):
    """What on-policy distillation reads (algorithm.name=distill): its own options and, for
    nft_coef > 0, DiffusionNFT's."""


@dataclass
class RAFTOptions:
    """RAFT's options (algorithm.name=raft), flat in the algorithm section."""

    raft_keep: int = option(1, "raft: best samples of each prompt group fine-tuned on", ge=1)


@dataclass
class FlowGRPOOptions(CreditOptions):
    """Flow-GRPO's options (algorithm.name=flow_grpo), flat in the algorithm section."""

    sde_noise: float = option(
        0.7, "flow_grpo: a in sigma_t = a sqrt(t / (1 - t)), the SDE's noise level", gt=0
    )
    clip_range: float = option(
        1e-4, "flow_grpo: the step ratio is clipped to [1 - clip_range, 1 + clip_range]", gt=0
    )
    adv_clip_max: float = option(
        5.0, "flow_grpo: advantages are clipped to [-adv_clip_max, adv_clip_max]", gt=0
    )
    per_group_std: bool = option(
        False,
        "flow_grpo: normalise by each group's std (default: the whole batch's, flow_grpo's default "
        "global_std=True)",
    )
    drop_zero_advantage: bool = option(
        True, "flow_grpo: samples whose advantage is exactly 0 are left out of the loss, as train_sd3.py does"
    )
    detach_uncond: bool = option(
        False,
        "flow_grpo: under guidance, no gradient through the unconditional velocity (flow_grpo's July 2025 "
        "train_sd3.py detached it; its current one does not)",
    )
    kl_coef: float = option(
        0.0,
        "flow_grpo: weight of each trained step's KL to the base model's, in flow_grpo's units (its "
        "train.beta: ||mean - mean_ref||^2 / 2 sigma_t^2; the Gaussian steps' KL is that / |dt|); 0 skips "
        "its forward",
        ge=0,
    )
    sde_window_size: int = option(
        0,
        "MixGRPO: the SDE (and training) only on a window of this many steps (0: every step but the last)",
        ge=0,
    )
    sde_window_stride: int = option(1, "MixGRPO: steps the window moves each time", ge=1)
    sde_window_every: int = option(1, "MixGRPO: updates between moves of the window", ge=1)
    sde_window_range: int = option(
        0,
        "Flow-GRPO-Fast: > 0 draws each step's window start from 0 .. this - sde_window_size (flow_grpo's "
        "sde_window_range (0, this)) instead of sliding it",
        ge=0,
    )
    updates_per_batch: int = option(
        1,
        "flow_grpo: optimizer steps per step of experience, each on its share of the prompt groups (the "
        "reference makes 2); after the first the ratio departs from 1 and the clip acts",
        ge=1,
    )


@dataclass
class AWMOptions(CreditOptions):
    """AWM's options (algorithm.name=awm), flat in the algorithm section; defaults are the
    reference's GenEval configuration (config/dgx_awm.py)."""

    adv_clip_max: float = option(5.0, "awm: advantages clipped to [-this, this], then divided by it", gt=0)
    per_group_std: bool = option(
        False, "awm: normalise by each group's std (default: the whole batch's, the reference's global_std)"
    )
    kl_coef: float = option(
        0.001,
        "awm: weight of mean (v - v_ref)^2 to the base model (the reference's train.beta: 0.001 GenEval, "
        "0.003 OCR, 1e-4 PickScore); 0 skips the base's forward",
        ge=0,
    )
    awm_ema_kl_coef: float = option(
        1.0,
        "awm: weight of mean (v - v_old)^2 to the lagged copy of the adapter (the reference's ema_beta); "
        "0 skips its forward",
        ge=0,
    )
    awm_ema_decay_max: float = option(
        0.3, "awm: the lagged copy's decay grows to this (the reference's kl_ema_decay)", ge=0, le=1
    )
    awm_ema_decay_per_step: float = option(
        0.001, "awm: ... by this much per update (the reference's linear kl_ema_decay_type)", ge=0, le=1
    )
    awm_timesteps: int = option(
        6, "awm: timesteps trained per sample, one in each stratum of the trained grid", ge=1, le=1000
    )
    awm_time_sampling: str = option(
        "discrete_wo_init",
        "awm: discrete_wo_init (the grid's indices 1 .. num_steps * timestep_fraction, never t = 1) | "
        "discrete (from index 0)",
        choices=AWM_TIME_SAMPLINGS,
    )
    awm_weighting: str = option(
        "ghuber",
        "awm: the log-likelihood surrogate: ghuber (-t (m^p - 0) / p of the matching error m) | uniform (-m)",
        choices=AWM_WEIGHTINGS,
    )
    awm_ghuber_power: float = option(0.25, "awm: p of the ghuber weighting", gt=0, le=1)


@dataclass
class GSPOOptions:
    """GSPO's options (algorithm.name=gspo, the autoregressive path), flat in the algorithm section."""

    clip_eps_low: float = option(
        3e-4, "gspo: the ratio is clipped to [1 - eps_low, 1 + eps_high]", gt=0, lt=1
    )
    clip_eps_high: float = option(4e-4, "gspo: upper clip (defaults from the GSPO paper)", gt=0)
    ratio_level: str = option(
        "sequence",
        "gspo: sequence (GSPO: one length-normalised ratio per answer) | token (GRPO's per-token ratio)",
        choices=RATIO_LEVELS,
    )
    max_new_tokens: int = option(16, "gspo: answer tokens at most (the end token included)", ge=1)
    min_new_tokens: int = option(
        0, "gspo: the end token is forbidden before this many (forced-long answers)", ge=0
    )
    temperature: float = option(1.0, "gspo: sampling temperature of the rollout answers", gt=0)
    adv_std: str = option(
        "population",
        "gspo: the std a group's advantages divide by: population (ddof 0) | sample (Bessel's "
        "correction, as trl's GRPOTrainer: advantages smaller by sqrt((G-1)/G), 0.935 at G=8)",
        choices=tuple(STD_CORRECTIONS),
    )
    rollout_backend: str = option(
        "hf",
        "gspo: what samples the rollout answers: hf (transformers, KV cache) | vllm (vLLM >= 0.11, "
        "installed separately; the rollout adapter served as a LoRA request per policy version)",
        choices=ANSWER_BACKENDS,
    )
    vllm_gpu_memory: float = option(
        0.3, "gspo, rollout_backend=vllm: the share of GPU memory vLLM's engine may take", gt=0, le=1
    )
    vllm_enforce_eager: bool = option(False, "gspo, rollout_backend=vllm: no CUDA graphs (faster start)")


# ---------------------------------------------------------------------------------------------
# The checks each algorithm makes of the rest of the config, as the config loads


def check_distill(cfg: ExperimentConfig) -> None:
    """Distillation's teachers are registered, its credit global, its targets fit its states."""
    from .registry import teachers

    if not cfg.teacher.routes:
        check_registered_name("teacher.name", cfg.teacher.name, teachers)
    for route, spec in cfg.teacher.routes.items():
        name = spec.get("name", "policy")
        if name != NO_TEACHER:
            check_registered_name(f"teacher.routes.{route}.name", name, teachers)
    a = cfg.algorithm
    if a.rollout_sde_noise > 0:
        raise ConfigError(
            f"algorithm.rollout_sde_noise={a.rollout_sde_noise}: distillation's teacher targets follow the "
            "states the student's ODE visited, so its rollouts do not sample an SDE; drop the key"
        )
    if a.credit != "global":
        raise ConfigError(
            "algorithm.credit=per_modality routes rewards' advantages; distillation learns from a "
            "teacher (teacher.routes gives each part of the latent its own teacher): use credit: global"
        )
    if a.distill_target in ("completion", "contrast") and a.distill_states != "visited":
        raise ConfigError(
            f"algorithm.distill_target={a.distill_target} starts the teacher from the states the "
            f"student visited; algorithm.distill_states={a.distill_states} is not: use visited"
        )
    if a.distill_target == "contrast" and any(
        spec.get("name") == NO_TEACHER for spec in cfg.teacher.routes.values()
    ):
        raise ConfigError(
            "algorithm.distill_target=contrast trains whole samples (DiffusionNFT's loss has no "
            "per-entry mask), so a teacher.routes entry with name: none would be trained anyway: "
            "give that route a teacher, or use another distill_target"
        )
    if a.distill_target == "contrast" and a.nft_coef > 0:
        raise ConfigError(
            "algorithm.distill_target=contrast already trains DiffusionNFT's loss, on the teacher's "
            "completions against the student's samples; algorithm.nft_coef would add the reward's on "
            "the same adapter with another meaning of r: set algorithm.nft_coef=0"
        )
    if a.distill_cond_coef > 0 and a.distill_target != "velocity":
        raise ConfigError(
            "algorithm.distill_cond_coef matches the teacher's velocities for the prompt and the empty "
            f"prompt at the same states; algorithm.distill_target={a.distill_target} has no such "
            "targets: use distill_target=velocity, or distill_cond_coef=0"
        )
    if a.distill_target == "completion":
        if a.distill_completions > cfg.sampling.num_steps:
            raise ConfigError(
                f"algorithm.distill_completions={a.distill_completions} is more than the "
                f"{cfg.sampling.num_steps} states a sample visits (sampling.num_steps): use at most that"
            )


def check_nft(cfg: ExperimentConfig) -> None:
    """SDE rollouts step like Euler."""
    if cfg.algorithm.rollout_sde_noise > 0 and cfg.sampling.solver not in SDE_SOLVERS:
        raise ConfigError(
            f"algorithm.rollout_sde_noise={cfg.algorithm.rollout_sde_noise} samples rollouts with an SDE, "
            f"and sampling.solver={cfg.sampling.solver} has none: use sampling.solver=euler, or "
            "rollout_sde_noise=0"
        )


def check_raft(cfg: ExperimentConfig) -> None:
    """RAFT keeps fewer samples than a group holds."""
    keep, size = cfg.algorithm.raft_keep, cfg.data.group_size
    if keep >= size:
        raise ConfigError(
            f"algorithm.raft_keep={keep} keeps every sample of a group of data.group_size={size}: "
            "nothing would be ranked; use fewer"
        )


def check_flow_grpo(cfg: ExperimentConfig) -> None:
    """Flow-GRPO's sampler has an SDE form and steps to train; its updates and window fit the step."""
    a, s = cfg.algorithm, cfg.sampling
    if s.solver not in SDE_SOLVERS:
        raise ConfigError(
            f"algorithm.name=flow_grpo samples with an SDE, and sampling.solver={s.solver} has none; "
            f"use one that does: {', '.join(SDE_SOLVERS)}"
        )
    if s.num_steps < 2:
        raise ConfigError(
            f"sampling.num_steps={s.num_steps}: flow_grpo needs at least 2 steps (the last one stays "
            "deterministic, so one step leaves nothing to train)"
        )
    if a.updates_per_batch > cfg.data.prompts_per_step:
        raise ConfigError(
            f"algorithm.updates_per_batch={a.updates_per_batch} splits data.prompts_per_step="
            f"{cfg.data.prompts_per_step} prompt groups: each update needs at least one; use fewer"
        )
    _check_sde_window(a, s.num_steps)


def _check_sde_window(a: Any, num_steps: int) -> None:
    if a.sde_window_range:
        if not 0 < a.sde_window_size <= a.sde_window_range <= num_steps - 1:
            raise ConfigError(
                f"algorithm.sde_window_range={a.sde_window_range} draws a window of sde_window_size="
                f"{a.sde_window_size} steps: it needs 0 < sde_window_size <= sde_window_range <= "
                f"{num_steps - 1} (the steps that may run the SDE at sampling.num_steps={num_steps})"
            )
    elif a.sde_window_size > num_steps - 2:
        raise ConfigError(
            f"algorithm.sde_window_size={a.sde_window_size} is larger than the {num_steps - 2} steps "
            f"MixGRPO's window covers (sampling.num_steps={num_steps}: its last two are never in it)"
        )


def awm_index_range(num_steps: int, fraction: float, count: int, skip_first: bool = True) -> tuple[int, int]:
    """The grid indices low..top that AWM draws `count` timesteps from (1 or 0 up to
    int(num_steps * fraction)); a ValueError naming the numbers when there is nothing to draw."""
    top = int(num_steps * fraction)
    low = 1 if skip_first else 0
    if count < 1 or top <= low:
        raise ValueError(
            f"AWM draws {count} timesteps from grid indices {low}..{top} (num_steps={num_steps}, "
            f"timestep_fraction={fraction}): it needs at least one of each"
        )
    return low, top


def check_awm(cfg: ExperimentConfig) -> None:
    """AWM's grid has indices to draw its timesteps from (a ValueError naming the numbers otherwise)."""
    a = cfg.algorithm
    skip_first = a.awm_time_sampling == "discrete_wo_init"
    awm_index_range(cfg.sampling.num_steps, a.timestep_fraction, a.awm_timesteps, skip_first)


def check_gspo(cfg: ExperimentConfig) -> None:
    """A rollout backend that cannot sample the family, or a system prompt the family cannot hold,
    is refused as the config loads (so `--check` refuses it too), not at the first rollout."""
    family = cfg.model.family
    if cfg.data.system_prompt is not None and family == "tiny_omni":
        raise ConfigError(
            "data.system_prompt: the tiny omni model has no chat template to hold a system turn (it "
            "reads the question alone); drop it, or use a chat model (qwen2_5_omni)"
        )
    if cfg.algorithm.rollout_backend == "vllm" and family in VLLM_REFUSED_FAMILIES:
        raise ConfigError(
            f"algorithm.rollout_backend=vllm cannot sample model.family={family}: its prompts carry "
            "their own positions (3D rope) and vLLM's prompt embeddings take plain ones; use "
            "algorithm.rollout_backend=hf"
        )


# ---------------------------------------------------------------------------------------------
# Cards: what loading a config needs of an algorithm, without its class


def no_check(cfg: ExperimentConfig) -> None:
    """An algorithm that checks nothing of the rest of the config."""


@dataclass(frozen=True)
class AlgorithmCard:
    """What a config needs of an algorithm: its options dataclass (None: it reads
    `algorithm.options`), whether a teacher feeds it, its checks of the rest of the config, and the
    name its progress bar and help show."""

    options_type: type | None
    display_name: str
    uses_teacher: bool = False
    check: Callable[[ExperimentConfig], None] = no_check


BUILTIN_CARDS = {
    "nft": AlgorithmCard(NFTOptions, "DiffusionNFT", check=check_nft),
    "distill": AlgorithmCard(DistillOptions, "distillation", uses_teacher=True, check=check_distill),
    "raft": AlgorithmCard(RAFTOptions, "RAFT", check=check_raft),
    "flow_grpo": AlgorithmCard(FlowGRPOOptions, "Flow-GRPO", check=check_flow_grpo),
    "awm": AlgorithmCard(AWMOptions, "AWM", check=check_awm),
    "gspo": AlgorithmCard(GSPOOptions, "GSPO", check=check_gspo),
}
"""The built-in algorithms' cards; tests/test_algorithm_options.py holds each equal to its class."""


def card_of_class(algorithm: Any) -> AlgorithmCard:
    """The card of a registered algorithm class (a plug-in declares it on the class)."""
    return AlgorithmCard(
        getattr(algorithm, "options_type", None),
        getattr(algorithm, "display_name", getattr(algorithm, "__name__", "algorithm")),
        bool(getattr(algorithm, "uses_teacher", False)),
        getattr(algorithm, "check", no_check),
    )


def algorithm_card(name: str) -> AlgorithmCard:
    """Algorithm `name`'s card: a built-in's without importing its trainer, unless this process has
    registered a class of its own under the name; a plug-in's from its class. A ConfigError lists the
    registered names when none is called `name`."""
    from .registry import algorithms

    check_registered_name("algorithm.name", name, algorithms)
    loaded = algorithms.loaded(name)
    if loaded is None and name in BUILTIN_CARDS:
        return BUILTIN_CARDS[name]
    return card_of_class(loaded if loaded is not None else algorithms.get(name))
