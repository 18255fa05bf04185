"""The synchrony rewards (rewards/sync.py) and the sync world's judge as a scorer
(rewards/tiny_sync_judge.py): the world's own clips score 1, and each way to game them scores less."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.world import tiny_sync as world

from .helpers import lopsided_bounce, shifted_wave


def _batch(scenes: list[world.SyncScene], audio: torch.Tensor | None = None) -> MediaBatch:
    video = torch.stack([world.render_video(s) for s in scenes])
    if audio is None:
        audio = world.render_audio(torch.stack([world.render_envelope(s) for s in scenes]))
    return MediaBatch(video=video, audio=audio, fps=world.FPS, sample_rate=world.SAMPLE_RATE)


def _single_scenes(count: int, seed: int) -> list[world.SyncScene]:
    rng = random.Random(seed)
    return [world.random_scene(rng) for _ in range(count)]


def test_the_worlds_clips_score_one_on_sync_count_and_the_judge() -> None:
    scenes = _single_scenes(24, seed=0)
    media, prompts = _batch(scenes), [s.prompt for s in scenes]
    assert rewards.create("sync_onsets").score(media, prompts).tolist() == [1.0] * 24
    assert rewards.create("strike_count").score(media, prompts).tolist() == [1.0] * 24
    judged = rewards.create("tiny_sync_judge").score(media, prompts)
    assert judged.scores.tolist() == [1.0] * 24 and judged.components["in_sync"].tolist() == [1.0] * 24


def test_sound_moved_off_the_strikes_loses_sync_credit_step_by_step() -> None:
    """Credit falls with the sound's distance from the strike, a quarter a frame: a frame off earns
    0.75 (inside AV-Align's window, yet less than on the strike), two frames 0.5, three 0.25."""
    scenes = [
        s
        for s in _single_scenes(80, seed=1)
        if s.objects[0].strikes[0] in range(4, 11) and s.objects[0].count == 1
    ]
    assert len(scenes) >= 8
    prompts = [s.prompt for s in scenes]
    reward = rewards.create("sync_onsets")
    base = _batch(scenes)
    means = []
    for k in (0, 1, 2, 3):
        moved = shifted_wave(base.audio, k * world.SAMPLE_RATE // int(world.FPS))
        means.append(float(reward.score(_batch(scenes, moved), prompts).mean()))
    assert means[0] == 1.0
    assert means[1:] == pytest.approx([0.75, 0.5, 0.25], abs=0.03)
    one_frame_off = _batch(scenes, shifted_wave(base.audio, world.SAMPLE_RATE // int(world.FPS)))
    sharp = rewards.create("sync_onsets", reach_frames=2)
    assert float(sharp.score(one_frame_off, prompts).mean()) == pytest.approx(0.5, abs=0.03)
    with pytest.raises(ValueError, match="reach_frames"):
        rewards.create("sync_onsets", reach_frames=0)


def test_motion_at_frames_pays_the_sound_on_a_lopsided_bounces_contact_most() -> None:
    """A bounce faster on one side of its contact (helpers.lopsided_bounce): read between frames, a
    sound a frame early earns more than the sound on the contact, so training has nothing to pull it
    onto the strike; read at frames (`motion_at: frames`), the sound on the contact earns 1 and a
    frame either side less."""
    frames, wave = lopsided_bounce(15)
    moved = [shifted_wave(wave, k * 44_100 // 24) for k in (-1, 0, 1)]
    media = MediaBatch(
        video=frames[None].expand(3, -1, -1, -1, -1),
        audio=torch.stack(moved)[:, None],
        fps=24.0,
        sample_rate=44_100,
    )
    prompts = ["a disc bounces once"] * 3
    early, on, late = rewards.create("sync_onsets").score(media, prompts).tolist()
    assert early > on > late
    early, on, late = rewards.create("sync_onsets", motion_at="frames").score(media, prompts).tolist()
    assert on == 1.0 and early == pytest.approx(0.75, abs=0.02) and late == pytest.approx(0.75, abs=0.02)
    with pytest.raises(ValueError, match="motion_at"):
        rewards.create("sync_onsets", motion_at="frame")


def test_gaming_clips_score_below_the_worlds_own() -> None:
    """A tone for the whole clip over a still square, a click on every frame over the right picture,
    and the right counts heard two frames late: each scores below the world's clip on sync."""
    scene = world.SyncScene((world.Bouncer("red", "large", 4, (4, 9)),))
    honest = _batch([scene])
    prompt = [scene.prompt]
    still = honest.video[:, :1].expand(-1, world.FRAMES, -1, -1, -1).contiguous()
    tone = torch.zeros(1, world.AUDIO_FRAMES, world.AUDIO_BINS)
    tone[0, :, world.PITCH_BINS["red"]] = 1.0
    clicks = torch.zeros(1, world.AUDIO_FRAMES, world.AUDIO_BINS)
    clicks[0, :: world.HOPS_PER_FRAME, world.PITCH_BINS["red"]] = 1.0
    cases = {
        "still square, steady tone": MediaBatch(
            still, world.render_audio(tone), world.FPS, world.SAMPLE_RATE
        ),
        "a click on every frame": MediaBatch(
            honest.video, world.render_audio(clicks), world.FPS, world.SAMPLE_RATE
        ),
        "right count, two frames late": MediaBatch(
            honest.video,
            shifted_wave(honest.audio, 2 * world.SAMPLE_RATE // 16),
            world.FPS,
            world.SAMPLE_RATE,
        ),
    }
    sync, count = rewards.create("sync_onsets"), rewards.create("strike_count")
    judge = rewards.create("tiny_sync_judge")
    assert float(sync.score(honest, prompt)[0]) == 1.0
    for name, media in cases.items():
        assert float(sync.score(media, prompt)[0]) <= 0.5, name
        assert float(judge.score(media, prompt).scores[0]) == 0.0, name
    assert float(count.score(cases["still square, steady tone"], prompt)[0]) < 0.5
    assert float(count.score(cases["a click on every frame"], prompt)[0]) < 0.7


def test_two_objects_side_by_side_score_one_when_the_picture_is_read_in_strips() -> None:
    """The recipe's option (motion_columns 4): the world's two-object clips score 1 on both rewards;
    read whole (the default), their strikes blur into each other's motion and miscount."""
    rng = random.Random(7)
    scenes = [world.random_scene(rng, second_object=1.0) for _ in range(16)]
    media, prompts = _batch(scenes), [s.prompt for s in scenes]
    for name in ("sync_onsets", "strike_count"):
        assert rewards.create(name, motion_columns=4).score(media, prompts).tolist() == [1.0] * 16
    assert float(rewards.create("strike_count").score(media, prompts).mean()) < 0.95
    with pytest.raises(ValueError, match="motion_columns must be a whole number"):
        rewards.create("strike_count", motion_columns=0)


def test_per_source_counts_each_object_where_summed_counts_cannot() -> None:
    """One object striking three times, or two objects sounding one pitch, has the right summed
    counts for "twice ..., and ... once": the summed reading gives full credit, the per-source one
    (sounds grouped by pitch, the picture in one region an object) does not. The world's own pairs
    still score 1."""
    import dataclasses

    rng = random.Random(11)
    pairs = [world.random_scene(rng, second_object=1.0) for _ in range(16)]
    per_source = rewards.create("strike_count", motion_columns=4, per_source=True)
    summed = rewards.create("strike_count", motion_columns=4)
    assert per_source.score(_batch(pairs), [s.prompt for s in pairs]).tolist() == [1.0] * 16

    asked = (
        "a small red square bounces twice with a low thud, and a large blue square bounces once with a knock"
    )
    one_object = world.SyncScene((world.Bouncer("red", "small", 2, (4, 8, 12)),))
    assert float(summed.score(_batch([one_object]), [asked])[0]) == 1.0
    assert float(per_source.score(_batch([one_object]), [asked])[0]) == 0.5

    pair = world.SyncScene(
        (world.Bouncer("red", "small", 2, (4, 10)), world.Bouncer("blue", "large", 10, (7,)))
    )
    one_pitch = world.SyncScene((pair.objects[0], dataclasses.replace(pair.objects[1], color="red")))
    media = _batch([pair], audio=world.render_audio(world.render_envelope(one_pitch)[None]))
    assert float(per_source.score(_batch([pair]), [asked])[0]) == 1.0
    assert float(summed.score(media, [asked])[0]) == 1.0
    assert float(per_source.score(media, [asked])[0]) == pytest.approx(0.5 * (1 / 2 + 1 / 2) / 2 + 0.5)
    with pytest.raises(ValueError, match="set motion_columns to 2 or more"):
        rewards.create("strike_count", per_source=True).score(media, [asked])
    with pytest.raises(ValueError, match="per_source must be true or false"):
        rewards.create("strike_count", per_source="yes")


def test_per_source_sync_pays_less_for_one_pitch_sounding_on_both_objects_strikes() -> None:
    """The red object strikes at 3 and 10, the blue one at 6 and 13, but red's pitch sounds at 3 and
    13 and blue's at 6 and 10: every sound is on some strike, so the whole-clip reading pays it in
    full; per source (sounds grouped by pitch, each group held to one region of the picture, one
    region an object, whichever group is which) it pays 0.625, and the judge finds neither in sync.
    The world's own pairs still score 1. (A clip whose two pitches are swapped between the objects
    still scores 1: which pitch is whose is the world's knowledge, not a generic reward's.)"""
    rng = random.Random(12)
    pairs = [world.random_scene(rng, second_object=1.0) for _ in range(16)]
    per_source = rewards.create("sync_onsets", motion_columns=4, per_source=True, motion_at="frames")
    assert per_source.score(_batch(pairs), [s.prompt for s in pairs]).tolist() == [1.0] * 16

    red, blue = world.Bouncer("red", "small", 2, (3, 10)), world.Bouncer("blue", "large", 10, (6, 13))
    pair = world.SyncScene((red, blue))
    crossed = world.SyncScene(
        (dataclasses.replace(red, strikes=(3, 13)), dataclasses.replace(blue, strikes=(6, 10)))
    )
    media = _batch([pair], audio=world.render_audio(world.render_envelope(crossed)[None]))
    prompt = [pair.prompt]
    assert float(rewards.create("sync_onsets", motion_columns=4).score(media, prompt)[0]) == 1.0
    assert float(per_source.score(media, prompt)[0]) == pytest.approx(0.625)
    assert float(rewards.create("tiny_sync_judge").score(media, prompt).components["in_sync"][0]) == 0.0
    with pytest.raises(ValueError, match="set motion_columns to 2 or more"):
        rewards.create("sync_onsets", per_source=True).score(media, prompt)
    with pytest.raises(ValueError, match="per_source must be true or false"):
        rewards.create("sync_onsets", per_source=1)


def test_strike_diversity_scores_the_worlds_own_spread_above_one_bounce_for_all() -> None:
    """Eight samples of a prompt with strikes drawn as the world draws them score well above eight
    copies of one clip (0); a still clip scores 0; a prompt alone in its batch cannot be scored (NaN,
    a failed sample, not a 0)."""
    rng = random.Random(3)
    reward = rewards.create("strike_diversity", motion_columns=4)
    world_means, copies = [], []
    for _ in range(4):
        prompt_scene = world.random_scene(rng, second_object=0.5)
        drawn = [world.another_draw(rng, prompt_scene) for _ in range(8)]
        prompts = [prompt_scene.prompt] * 8
        world_means.append(float(reward.score(_batch(drawn), prompts).mean()))
        copies.append(float(reward.score(_batch([drawn[0]] * 8), prompts).mean()))
    assert copies == [0.0] * 4 and min(world_means) > 0.3 and sum(world_means) / 4 > 0.5
    scenes = _single_scenes(3, seed=9)
    media = _batch(scenes)
    still = MediaBatch(
        media.video[:, :1].expand(-1, world.FRAMES, -1, -1, -1).contiguous(),
        media.audio,
        world.FPS,
        world.SAMPLE_RATE,
    )
    assert reward.score(still, [scenes[0].prompt] * 3).tolist() == [0.0] * 3
    lone = reward.score(media, [s.prompt for s in scenes])
    assert bool(lone.isnan().all())
    with pytest.raises(ValueError, match="spread is in frames"):
        rewards.create("strike_diversity", spread=0)


def test_probe_every_gaming_clip_scores_below_the_worlds_own_and_the_judge_fails_it() -> None:
    """`odrl probe-rewards` on the recipe's rewards: each way to game them (a glide with a steady
    tone, a sound on every frame, the right count out of sync, ...) totals well under the world's
    own clips, and the judge finds no such clip right. A wrong colour is outside these rewards (they
    read timing): only the judge fails it."""
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.reward_factory import reward_from_config
    from omni_diffusion_rl.world import sync_adversarial

    reward = reward_from_config(load_config("recipes/configs/tiny_sync_nft.yaml", []).reward)
    table = sync_adversarial.probe_rewards(reward, count=12)
    assert table["total"]["world"] == 1.0 and table["judge: every fact right"]["world"] == 1.0
    for case in sync_adversarial.CASES:
        assert table["judge: every fact right"][case] == 0.0, case
        if case not in sync_adversarial.NOT_GAMING:
            assert table["total"][case] <= 0.85, (case, table["total"][case])
    assert table["total"]["wrong_color"] == 1.0


def test_a_prompt_without_a_count_and_media_without_sound_are_errors() -> None:
    scenes = _single_scenes(1, seed=2)
    media = _batch(scenes)
    with pytest.raises(ValueError, match="asks for no count"):
        rewards.create("strike_count").score(media, ["a red square"])
    silent = MediaBatch(video=media.video, fps=world.FPS)
    with pytest.raises(ValueError, match="need video and audio"):
        rewards.create("sync_onsets").score(silent, [scenes[0].prompt])
    other_size = MediaBatch(
        video=media.video[:, :8], audio=media.audio, fps=world.FPS, sample_rate=world.SAMPLE_RATE
    )
    with pytest.raises(ValueError, match="tiny sync world's clips"):
        rewards.create("tiny_sync_judge").score(other_size, [scenes[0].prompt])


def test_heard_and_seen_count_score_one_modality_each_and_strike_count_is_their_mean() -> None:
    """A picture striking three times under a sound striking twice, asked "twice": the sound's count
    is right and the picture's one off; each single-modality reward sees only its own."""
    seen = world.SyncScene((world.Bouncer("green", "small", 3, (4, 8, 12)),))
    heard = world.SyncScene((world.Bouncer("green", "small", 3, (4, 12)),))
    media = _batch([seen], audio=world.render_audio(world.render_envelope(heard)[None]))
    asked = [heard.prompt]
    scores = {
        name: float(rewards.create(name).score(media, asked)[0]) for name in ("heard_count", "seen_count")
    }
    assert scores == {"heard_count": 1.0, "seen_count": 0.5}
    assert float(rewards.create("strike_count").score(media, asked)[0]) == 0.75
    declared = {name: rewards.create(name).modality for name in ("heard_count", "seen_count", "strike_count")}
    assert declared == {"heard_count": "audio", "seen_count": "video", "strike_count": "audio_video"}
