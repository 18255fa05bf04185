"""Metric logging: a JSONL file per run, optional wandb through accelerate's trackers, and reward plots."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from omni_diffusion_rl.media import atomic_write

if TYPE_CHECKING:
    from accelerate import Accelerator

METRICS_FILE = "metrics.jsonl"
WANDB_MISSING = (
    "tracking with wandb was requested but the wandb package is not installed: "
    "run `pip install wandb`, or set tracking.wandb=false"
)


def flatten_config(config: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """Flatten nested dicts to {"a.b.c": value}; values that are not int/float/str/bool become strings."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, name, sep))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def _scalar(value: Any) -> Any:
    """A tensor or numpy scalar as a plain Python number; anything else unchanged."""
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def wandb_available() -> bool:
    """Whether the wandb package can be imported."""
    return importlib.util.find_spec("wandb") is not None


def _logs_to_wandb(accelerator: Accelerator) -> bool:
    """Whether the accelerator was built with wandb among its trackers (log_with="wandb")."""
    for tracker in getattr(accelerator, "log_with", None) or []:
        if str(tracker) == "wandb" or getattr(tracker, "name", None) == "wandb":
            return True
    return False


class MetricsLogger:
    """Append one JSON object per `log` call to `{output_dir}/metrics.jsonl`, and mirror to wandb if asked.

    Without an accelerator it is a plain single-process JSONL writer. With one (or with
    `is_main_process` given), only the main process writes. With `use_wandb`, an accelerator must
    have been built with `log_with="wandb"` (without one, as in the trainer processes of separate
    mode, wandb is used directly); the run is offline unless WANDB_MODE says otherwise, and its
    files go under `output_dir/wandb`. Loggers given the same `run_id` (a resumed run, auto's next
    mode) continue one wandb run.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        accelerator: Accelerator | None = None,
        use_wandb: bool = False,
        project: str = "omni-diffusion-rl",
        run_name: str = "run",
        config: Mapping[str, Any] | None = None,
        run_id: str | None = None,
        is_main_process: bool | None = None,
    ) -> None:
        self.output_dir = os.fspath(output_dir)
        self.accelerator = accelerator
        self.use_wandb = use_wandb
        if is_main_process is None:  # given: whether this is the process that logs for all
            is_main_process = accelerator is None or accelerator.is_main_process
        self.is_main_process = is_main_process
        self.path = os.path.join(self.output_dir, METRICS_FILE)
        self._trackers_started = False
        self._run: Any = None  # the wandb run when logging without an accelerator
        self._closed = False

        if use_wandb:
            if not wandb_available():
                raise ImportError(WANDB_MISSING)
            if accelerator is not None and not _logs_to_wandb(accelerator):
                raise ValueError(
                    "use_wandb=True but the accelerator has no wandb tracker: build it with "
                    "Accelerator(log_with='wandb'), or set tracking.wandb=false"
                )

        self._file: io.TextIOWrapper | None = None
        if self.is_main_process:
            os.makedirs(self.output_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # closed in close()

        if use_wandb:
            os.environ.setdefault("WANDB_MODE", "offline")
            settings: dict[str, Any] = {"name": run_name, "dir": self.output_dir}
            if run_id:
                settings.update(id=run_id, resume="allow")
            if accelerator is None and self.is_main_process:
                import wandb

                self._run = wandb.init(project=project, config=flatten_config(config or {}), **settings)
            elif accelerator is not None:
                accelerator.init_trackers(
                    project, config=flatten_config(config or {}), init_kwargs={"wandb": settings}
                )
                self._trackers_started = True

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record `metrics` at `step`: one JSONL line (flushed at once) and, with wandb, one tracker entry."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        values = {str(key): _scalar(value) for key, value in metrics.items()}
        if self._file is not None:
            self._file.write(json.dumps({"step": int(step), **values}) + "\n")
            self._file.flush()
        if self._trackers_started and self.accelerator is not None:
            self.accelerator.log(values, step=int(step))
        if self._run is not None:
            self._run.log(values, step=int(step))

    def close(self) -> None:
        """Close the JSONL file and finish the trackers if they were started."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._trackers_started and self.accelerator is not None:
            # not accelerator.end_training(): it also destroys the process group, which the run
            # may still need (auto's next mode; odrl train tears it down at exit)
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.trackers = []
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a metrics JSONL file; a cut-off last line (crash mid-write) is skipped, other bad lines raise."""
    with open(path, encoding="utf-8") as handle:
        lines = [line for line in handle.read().splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines) - 1:
                break
            raise
    return records


def _series(metrics: Iterable[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records holding a finite number under `key`; records without a step use
    their position."""
    steps: list[float] = []
    values: list[float] = []
    for position, record in enumerate(metrics):
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        steps.append(float(record.get("step", position)))
        values.append(float(value))
    return steps, values


def plot_reward_curve(
    metrics: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    keys: Sequence[str] = ("reward/mean",),
) -> None:
    """Plot reward against step and save it as PNG (atomically).

    One line per key in `keys` that appears, plus every other `reward/...` metric; a `.../std` key is
    drawn as a band around its `.../mean` line instead of as a line of its own.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    present = {key for record in metrics for key in record}
    names = [key for key in keys if key in present]
    names += sorted(key for key in present if key.startswith("reward/") and key not in names)
    bands = {name[: -len("/mean")] + "/std" for name in names if name.endswith("/mean")}
    names = [name for name in names if name not in bands]

    figure = Figure(figsize=(7.0, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    drawn = 0
    for name in names:
        steps, values = _series(metrics, name)
        if not steps:
            continue
        (line,) = axes.plot(steps, values, label=name, linewidth=1.5)
        drawn += 1
        band = name[: -len("/mean")] + "/std" if name.endswith("/mean") else None
        if band in present:
            spread = dict(zip(*_series(metrics, band), strict=True))
            paired = [(s, v, spread[s]) for s, v in zip(steps, values, strict=True) if s in spread]
            if paired:
                axes.fill_between(
                    [s for s, _, _ in paired],
                    [v - d for _, v, d in paired],
                    [v + d for _, v, d in paired],
                    color=line.get_color(),
                    alpha=0.2,
                    linewidth=0,
                )
    axes.set_xlabel("step")
    axes.set_ylabel("reward")
    axes.grid(True, alpha=0.3)
    if drawn:
        axes.legend(loc="best", fontsize="small")
    else:
        note = "no reward metrics logged yet"
        axes.text(0.5, 0.5, note, ha="center", va="center", transform=axes.transAxes)
    figure.tight_layout()
    atomic_write(path, lambda handle: figure.savefig(handle, format="png"))
