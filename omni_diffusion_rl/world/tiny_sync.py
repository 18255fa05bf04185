"""The tiny sync world: objects that bounce on the floor, each strike a sound on the strike's frame.

Every fact of the world lives here, so that an evaluator can read them without reading the rewards:

- **A clip** is FRAMES frames of SIZE x SIZE pixels at FPS (one second) on a dark background, and
  one second of mono audio at SAMPLE_RATE. Its audio is an amplitude envelope of AUDIO_FRAMES
  frames (HOPS_PER_FRAME a video frame, so a one-frame offset is four envelope frames) over
  AUDIO_BINS frequency bins, synthesised into a waveform by the fixed vocoder of `tiny_clip`.
- **An object** is a square of a colour (COLORS) and a size (SIZES, its side in pixels) in a column
  of the frame. It strikes the floor (the bottom row) on each of its strike frames: it touches the
  floor exactly then. Between strikes it flies a parabolic arc that moves IMPACT_SPEED pixels in the
  frame before and in the frame after every strike (less than a small object's side), so the
  picture moves most, and as much on either side, around a strike. Before its first strike it is
  held still at the top of such an arc (LEAD_GAP frames long) and falls from there; after its last
  it rises to the top of one and stays there.
- **A strike's sound** starts on the strike's frame: its colour's pitch (PITCH_BINS, with a quieter
  octave above for timbre) decaying by DECAY a envelope frame. The sound rises between the envelope
  frames around the strike's time, so its onset is the strike's time.
- **Counts**: an object strikes 1 to 3 times (COUNT_WORDS), at least MIN_GAP frames apart, within
  FIRST_STRIKE..LAST_STRIKE. Two objects never strike within PAIR_GAP frames of each other, so that
  every strike is a sound of its own (two strikes a frame apart are one sound to any listener).
- **Prompts** name each object's size, colour, count and sound: "a small red square bounces twice
  with a low thud". A second object may follow ("..., and a large blue square bounces once with a
  knock"). Held-out prompts are combinations never trained on, and other wordings of them.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

import torch

# The clip format lives below both the world and the model; these names stay importable from here.
from .sync_clip import AUDIO_BINS as AUDIO_BINS
from .sync_clip import AUDIO_FRAMES as AUDIO_FRAMES
from .sync_clip import BACKGROUND as BACKGROUND
from .sync_clip import (
    COLUMN_CENTRE,
    COLUMN_RANGE,
    MAX_HEIGHT,
    MAX_SIDE,
    PARTS,
    SLOT_DIM,
    SLOTS,
    decode_amps,
    decode_video,
    from_unit,
    synthesize_sync,
)
from .sync_clip import DURATION_S as DURATION_S
from .sync_clip import FPS as FPS
from .sync_clip import FRAMES as FRAMES
from .sync_clip import HOPS_PER_FRAME as HOPS_PER_FRAME
from .sync_clip import SAMPLE_RATE as SAMPLE_RATE
from .sync_clip import SIZE as SIZE

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.15, 0.15),
    "green": (0.15, 0.8, 0.2),
    "blue": (0.2, 0.3, 0.95),
    "yellow": (0.95, 0.85, 0.15),
}
SIZES = {"small": 3, "large": 5}
SOUNDS = {"red": "low thud", "blue": "knock", "green": "clink", "yellow": "high ping"}
"""The sound each colour makes when it strikes (the prompt names it)."""
PITCH_BINS = {"red": 0, "blue": 3, "green": 9, "yellow": 11}
"""Each colour's pitch (a bin of the envelope), its overtone OVERTONE bins above: no pitch is another
colour's overtone."""
OVERTONE, OVERTONE_GAIN = 4, 0.4  # an octave up (4 bins), quieter: a struck object, not a sine
DECAY = 0.55  # the sound's amplitude kept from one envelope frame to the next (about 42 ms to 1/e)
IMPACT_SPEED = 2.0  # pixels moved in the frame before and in the frame after every strike
COUNT_WORDS = {1: "once", 2: "twice", 3: "three times"}
FIRST_STRIKE, LAST_STRIKE, MIN_GAP, LEAD_GAP = 3, 13, 4, 6
PAIR_GAP = 2  # frames between any strike of one object and any of the other: each strike heard on its own
COLUMNS = tuple(range(1, SIZE - 5))  # an object's left column (a large one fits on every one)
PAIR_COLUMNS = ((1, 2), (9, 10))  # two objects: one in each half, never overlapping
HELD_OUT_COMBINATIONS = {
    ("green", "small", 2),
    ("blue", "large", 3),
    ("yellow", "small", 1),
    ("red", "large", 2),
}
"""(colour, size, count) never trained on, alone or as either object of two."""


@dataclass(frozen=True)
class Bouncer:
    """One object: its colour, size, column and strike frames (increasing)."""

    color: str
    size: str
    column: int
    strikes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.color not in COLORS or self.size not in SIZES:
            raise ValueError(
                f"unknown object {self.size!r} {self.color!r}: sizes {list(SIZES)}, colours {list(COLORS)}"
            )
        if not 1 <= len(self.strikes) <= max(COUNT_WORDS):
            raise ValueError(f"an object strikes 1 to {max(COUNT_WORDS)} times; got {self.strikes}")
        gaps = [b - a for a, b in itertools.pairwise(self.strikes)]
        if (
            any(g < MIN_GAP for g in gaps)
            or not FIRST_STRIKE <= self.strikes[0] <= self.strikes[-1] <= LAST_STRIKE
        ):
            raise ValueError(
                f"strikes {self.strikes}: {MIN_GAP}+ frames apart within {FIRST_STRIKE}..{LAST_STRIKE}"
            )

    @property
    def count(self) -> int:
        return len(self.strikes)

    @property
    def phrase(self) -> str:
        return (
            f"a {self.size} {self.color} square bounces {COUNT_WORDS[self.count]} with a {SOUNDS[self.color]}"
        )

    def height(self, t: torch.Tensor) -> torch.Tensor:
        """Height above the floor (pixels) at frame times t: parabolic arcs between strikes, each
        IMPACT_SPEED pixels high one frame after it leaves the floor and one frame before it lands."""
        ends = [self.strikes[0] - LEAD_GAP, *self.strikes, self.strikes[-1] + LEAD_GAP]
        t = t.double().clamp(ends[0] + LEAD_GAP / 2, ends[-1] - LEAD_GAP / 2)  # held at the lead arcs' tops
        out = torch.zeros_like(t)
        for a, b in itertools.pairwise(ends):
            inside = (t >= a) & (t <= b)
            since = t[inside] - a
            out[inside] = IMPACT_SPEED * since * (b - a - since) / (b - a - 1)
        return out


@dataclass(frozen=True)
class SyncScene:
    """A clip of the world: one or two objects."""

    objects: tuple[Bouncer, ...]

    @property
    def prompt(self) -> str:
        return ", and ".join(o.phrase for o in self.objects)


def encode_scene(scene: SyncScene) -> torch.Tensor:
    """The scene's latent [LATENT_DIM] (sync_clip's format): each object in a slot of its own, its
    colour, size, column, its height on every frame, its colour's spectrum and its strikes' loudness;
    slots left over draw and sound nothing."""
    if len(scene.objects) > SLOTS:
        raise ValueError(f"a sync clip holds at most {SLOTS} objects; got {len(scene.objects)}")
    slots = torch.zeros(SLOTS, SLOT_DIM)
    slots[:, PARTS["side"][0]] = -1.0  # side 0: nothing drawn
    slots[:, PARTS["height"][0] : PARTS["height"][0] + FRAMES] = -1.0
    for name in ("spectrum", "loudness"):
        start, length = PARTS[name]
        slots[:, start : start + length] = -1.0
    for slot, obj in zip(slots, scene.objects, strict=False):
        quantities = {
            "color": torch.tensor(COLORS[obj.color]),
            "side": torch.tensor([SIZES[obj.size] / MAX_SIDE]),
            "height": height_of(obj),
            "spectrum": spectrum_of(obj.color),
            "loudness": loudness_of(obj.strikes),
        }
        for name, value in quantities.items():
            start, length = PARTS[name]
            slot[start : start + length] = from_unit(value)
        slot[PARTS["column"][0]] = (obj.column - COLUMN_CENTRE) / COLUMN_RANGE
    return slots.flatten()


def height_of(obj: Bouncer) -> torch.Tensor:
    """An object's height on every frame [FRAMES], as a share of MAX_HEIGHT."""
    return (obj.height(torch.arange(FRAMES, dtype=torch.float64)) / MAX_HEIGHT).float()


def spectrum_of(color: str) -> torch.Tensor:
    """A colour's strike spectrum [AUDIO_BINS]: its pitch, and a quieter octave above."""
    spectrum = torch.zeros(AUDIO_BINS)
    spectrum[PITCH_BINS[color]] = 1.0
    spectrum[PITCH_BINS[color] + OVERTONE] = OVERTONE_GAIN
    return spectrum


def loudness_of(strikes: tuple[int, ...]) -> torch.Tensor:
    """Loudness [AUDIO_FRAMES]: each strike full on the envelope frame centred just after its time
    (frame j is centred at j + 1/2 hops, so the rise is centred on the strike) and decaying."""
    frames = torch.arange(AUDIO_FRAMES, dtype=torch.float64)
    loudness = torch.zeros(AUDIO_FRAMES, dtype=torch.float64)
    for strike in strikes:
        since = frames - strike * HOPS_PER_FRAME
        loudness = torch.maximum(loudness, torch.where(since >= 0, DECAY**since, torch.zeros_like(since)))
    return loudness.float()


def render_video(scene: SyncScene) -> torch.Tensor:
    """Frames [FRAMES, 3, SIZE, SIZE] in [0, 1], through the sync clip decoder."""
    return decode_video(encode_scene(scene)[None])[0]


def render_envelope(scene: SyncScene) -> torch.Tensor:
    """Amplitudes [AUDIO_FRAMES, AUDIO_BINS] in [0, 1], through the sync clip decoder."""
    return decode_amps(encode_scene(scene)[None])[0]


def render_audio(amps: torch.Tensor) -> torch.Tensor:
    """Waveforms [B, 1, SAMPLE_RATE * DURATION_S] from envelopes [B, AUDIO_FRAMES, AUDIO_BINS]."""
    return synthesize_sync(amps)


@functools.cache
def strike_options(count: int) -> tuple[tuple[int, ...], ...]:
    """Every allowed set of `count` strike frames."""
    frames = range(FIRST_STRIKE, LAST_STRIKE + 1)
    return tuple(
        c
        for c in itertools.combinations(frames, count)
        if all(b - a >= MIN_GAP for a, b in itertools.pairwise(c))
    )


def random_bouncer(rng: random.Random, color: str, size: str, count: int) -> Bouncer:
    return Bouncer(color, size, rng.choice(COLUMNS), rng.choice(strike_options(count)))


def is_held_out(obj: tuple[str, str, int]) -> bool:
    return obj in HELD_OUT_COMBINATIONS


def object_kinds(held_out: bool) -> list[tuple[str, str, int]]:
    """(colour, size, count) of the training split or of the held-out one."""
    every = itertools.product(COLORS, SIZES, COUNT_WORDS)
    return [k for k in every if is_held_out(k) == held_out]


def random_scene(rng: random.Random, held_out: bool = False, second_object: float = 0.0) -> SyncScene:
    """A scene of the split: one object, or with probability `second_object` two of different
    colours in columns apart (a held-out scene has at least one held-out object)."""
    kinds = object_kinds(held_out)
    first = rng.choice(kinds)
    objects = [random_bouncer(rng, *first)]
    if rng.random() < second_object:
        others = [k for k in object_kinds(False) + object_kinds(True) if k[0] != first[0]]
        others = [k for k in others if held_out or not is_held_out(k)]
        objects = placed_apart(rng, [objects[0], random_bouncer(rng, *rng.choice(others))])
    return SyncScene(tuple(objects))


def another_draw(rng: random.Random, scene: SyncScene) -> SyncScene:
    """Another clip of `scene`'s prompt, as the world draws one: the same objects, their columns and
    strike frames drawn afresh."""
    objects = [random_bouncer(rng, o.color, o.size, o.count) for o in scene.objects]
    return SyncScene(tuple(placed_apart(rng, objects) if len(objects) == 2 else objects))


def placed_apart(rng: random.Random, pair: list[Bouncer]) -> list[Bouncer]:
    """Two objects moved to columns of PAIR_COLUMNS, one in each half of the frame, their strikes
    PAIR_GAP frames apart or more (`apart_strikes`)."""
    strikes = apart_strikes(pair[0].strikes, pair[1].strikes)
    return [
        Bouncer(o.color, o.size, rng.choice(c), s)
        for o, c, s in zip(pair, PAIR_COLUMNS, strikes, strict=True)
    ]


def apart_strikes(first: tuple[int, ...], second: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Strike frames for two objects with their counts, no strike of one within PAIR_GAP frames of
    one of the other: the drawn ones when they are, else the allowed pair nearest to them (fewest
    frames moved; no randomness drawn, so a split's prompts never depend on it)."""

    def apart(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
        return all(abs(x - y) >= PAIR_GAP for x in a for y in b)

    if apart(first, second):
        return first, second
    options = [(a, b) for a in strike_options(len(first)) for b in strike_options(len(second)) if apart(a, b)]

    def moved(option: tuple[tuple[int, ...], tuple[int, ...]]) -> int:
        pairs = zip((*first, *second), (*option[0], *option[1]), strict=True)
        return sum(abs(x - y) for x, y in pairs)

    return min(options, key=moved)


def clip_tensors(scene: SyncScene) -> tuple[torch.Tensor, torch.Tensor]:
    """(frames [FRAMES, 3, SIZE, SIZE], waveform [1, S]) of a scene."""
    return render_video(scene), render_audio(render_envelope(scene)[None])[0]


@dataclass(frozen=True)
class BaseNoise:
    """How the base's training clips deviate from their prompts (what post-training must fix):
    a clip's sound moved by `offsets` frames (drawn with `offset_weights`) from its strikes, and
    each modality's strike count off by one with probability `count_flip`."""

    offsets: tuple[int, ...] = (-3, -2, -1, 0, 1, 2, 3)
    offset_weights: tuple[float, ...] = (0.26, 0.2, 0.02, 0.04, 0.02, 0.2, 0.26)
    count_flip: float = 0.45


def _other_count(rng: random.Random, count: int) -> int:
    return rng.choice([c for c in (count - 1, count + 1) if c in COUNT_WORDS])


def _with_count(rng: random.Random, strikes: tuple[int, ...], count: int) -> tuple[int, ...]:
    """`strikes` with one dropped or one added (where the rules allow) to make `count`."""
    if count < len(strikes):
        drop = rng.randrange(len(strikes))
        return strikes[:drop] + strikes[drop + 1 :]
    options = [s for s in strike_options(count) if set(strikes) <= set(s)]
    return rng.choice(options) if options else rng.choice(strike_options(count))


def noisy_clip_latent(rng: random.Random, scene: SyncScene, noise: BaseNoise) -> torch.Tensor:
    """The latent of a clip for `scene`'s prompt as the base learns it: each object's picture with
    its count off by one at times, its sound's strikes moved by one offset for the clip (kept
    within the clip) and their count off by one at times. The prompt stays `scene.prompt`."""
    offset = rng.choices(noise.offsets, weights=noise.offset_weights)[0]
    latent = encode_scene(scene).view(SLOTS, SLOT_DIM).clone()
    for slot, obj in zip(latent, scene.objects, strict=False):
        seen = obj.strikes
        if rng.random() < noise.count_flip:
            seen = _with_count(rng, seen, _other_count(rng, len(seen)))
        heard = seen
        if rng.random() < noise.count_flip:
            heard = _with_count(rng, heard, _other_count(rng, len(heard)))
        heard = tuple(min(max(s + offset, 1), FRAMES - 2) for s in heard)
        start, length = PARTS["height"]
        slot[start : start + length] = from_unit(height_of(Bouncer(obj.color, obj.size, obj.column, seen)))
        start, length = PARTS["loudness"]
        slot[start : start + length] = from_unit(loudness_of(heard))
    return latent.flatten()


def training_batch(
    rng: random.Random,
    size: int,
    noise: BaseNoise,
    second_object: float = 0.5,
    fillers: int = 0,
    window: int = 24,
) -> tuple[list[str], torch.Tensor]:
    """`size` prompts of the training split and their noisy clips' latents [size, LATENT_DIM]; with
    `fillers`, each prompt gets up to that many filler words (`with_fillers`) within `window` words."""
    scenes = [random_scene(rng, second_object=second_object) for _ in range(size)]
    prompts = [with_fillers(rng, s.prompt, fillers, window) if fillers else s.prompt for s in scenes]
    return prompts, torch.stack([noisy_clip_latent(rng, s, noise) for s in scenes])


FILLER_WORDS = (
    "then", "now", "look", "here", "wow", "hmm", "watch", "next", "there", "this", "just", "well",
    "oh", "okay", "yes", "right", "quite", "really", "very", "still", "again", "soon", "maybe", "later",
    "you", "it", "our", "indeed", "scene", "shot", "clip", "frame", "slowly", "quickly", "below", "above",
)  # fmt: skip
"""Words that mean nothing in this world. Inserted at random places into the base's training
prompts (`with_fillers`), they make a model of hashed words meet every attribute word at many
positions, not only where the training wording puts it. None is a word of either wording."""


def with_fillers(rng: random.Random, prompt: str, most: int, window: int) -> str:
    """`prompt` with 0..`most` filler words at random places, the whole within `window` words."""
    words = prompt.split()
    room = max(0, min(most, window - len(prompt.replace(",", " ").split())))
    for _ in range(rng.randint(0, room)):
        words.insert(rng.randint(0, len(words)), rng.choice(FILLER_WORDS))
    return " ".join(words)


# ---------------------------------------------------------------- prompts: wordings and splits
SIZE_WORDS = {"small": ("small", "little", "tiny"), "large": ("large", "big")}
COUNT_PHRASES = {1: ("once", "one time"), 2: ("twice", "two times"), 3: ("three times", "thrice")}
PARAPHRASES = (
    "a {size} {color} block hits the floor {count}, each hit a {sound}",
    "the floor is struck {count} by a {size} {color} square, with a {sound}",
)
"""Held-out wordings (never trained on): other sentences around the attribute words the training
prompts use (a model of hashed words cannot know that "big" means large); the parser reads the
synonyms too."""


@dataclass(frozen=True)
class ObjectSpec:
    """What a prompt asks of one object."""

    color: str
    size: str
    count: int


def paraphrase(scene: SyncScene, variant: int) -> str:
    """The scene's prompt in held-out wording `variant` (its objects joined by ', and ')."""
    parts = []
    for i, obj in enumerate(scene.objects):
        template = PARAPHRASES[(variant + i) % len(PARAPHRASES)]
        parts.append(
            template.format(
                size=obj.size, color=obj.color, count=COUNT_WORDS[obj.count], sound=SOUNDS[obj.color]
            )
        )
    return ", and ".join(parts)


def parse_prompt(prompt: str) -> list[ObjectSpec]:
    """The objects a prompt of this world asks for, in either wording; a ValueError names what is
    missing. Objects are the parts between ', and '."""
    specs = []
    for part in prompt.lower().split(", and "):
        text = " " + " ".join(part.replace(",", " ").split()) + " "
        words = set(text.split())
        colors = [c for c in COLORS if c in words]
        sizes = [s for s, names in SIZE_WORDS.items() if words & set(names)]
        counts = [n for n, phrases in COUNT_PHRASES.items() if any(f" {p} " in text for p in phrases)]
        if len(colors) != 1 or len(sizes) != 1 or len(counts) != 1:
            raise ValueError(
                f"not a tiny sync prompt: {part!r} should name one colour ({', '.join(COLORS)}), one size "
                f"and one count (once, twice, three times)"
            )
        specs.append(ObjectSpec(colors[0], sizes[0], counts[0]))
    return specs


def _prompt_scenes(held_out: bool, count: int, seed: int, second_object: float) -> list[SyncScene]:
    rng = random.Random(seed)
    seen: dict[str, SyncScene] = {}
    while len(seen) < count:
        scene = random_scene(rng, held_out=held_out, second_object=second_object)
        seen.setdefault(scene.prompt, scene)
    return list(seen.values())


def _train_prompts() -> list[str]:
    """Every training kind alone, and 40 pairs of training kinds (training wording)."""
    single = [
        SyncScene((Bouncer(c, s, COLUMNS[0], strike_options(n)[0]),)).prompt
        for c, s, n in object_kinds(False)
    ]
    pairs = [scene.prompt for scene in _prompt_scenes(False, 40, seed=1, second_object=1.0)]
    return single + pairs


def _heldout_prompts() -> list[str]:
    """16: the held-out kinds alone (training wording), 4 held-out pairs, and 8 training-split
    scenes in held-out wordings."""
    single = [
        SyncScene((Bouncer(c, s, COLUMNS[0], strike_options(n)[0]),)).prompt for c, s, n in object_kinds(True)
    ]
    pairs = [
        scene.prompt
        for scene in _prompt_scenes(True, 4, seed=2, second_object=1.0)
        if len(scene.objects) == 2
    ]
    reworded = [
        paraphrase(scene, i) for i, scene in enumerate(_prompt_scenes(False, 8, seed=3, second_object=0.25))
    ]
    return single + pairs + reworded


TRAIN_PROMPTS = _train_prompts()
HELDOUT_PROMPTS = _heldout_prompts()


def render_prompts(prompts: list[str], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The world's own clips of sync prompts (strike frames and columns drawn from `gen`): video
    [B, FRAMES, 3, SIZE, SIZE] and waveform [B, 1, S]; None when a prompt is not one of this world's
    (then there is no reference to show)."""
    try:
        specs = [parse_prompt(p) for p in prompts]
    except ValueError:
        return None
    if not specs or any(len(s) > SLOTS for s in specs):
        return None
    rng = random.Random(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    scenes = []
    for spec in specs:
        objects = [random_bouncer(rng, o.color, o.size, o.count) for o in spec]
        if len(objects) == 2:
            objects = placed_apart(rng, objects)
        scenes.append(SyncScene(tuple(objects)))
    latents = torch.stack([encode_scene(s) for s in scenes])
    return decode_video(latents), render_audio(decode_amps(latents))
