"""The generated world: deterministic, captions that say what happens, coarse grids, bindings."""

from __future__ import annotations

import torch

from lmpm.models import world


def test_same_seed_same_world() -> None:
    a, b = world.generate(6, seed=5), world.generate(6, seed=5)
    assert torch.equal(a.videos, b.videos) and a.captions == b.captions
    assert not torch.equal(a.videos, world.generate(6, seed=6).videos)


def test_scene_content_matches_caption() -> None:
    w = world.generate(40, seed=3)
    sky = world.sky_rows(32)
    for v, cap, s in zip(w.videos, w.captions, w.scenes):
        assert len(cap) <= 64 and cap == cap.lower()
        for shape in s.shapes:
            assert shape.colour.encode() in cap and shape.direction.encode() in cap
        # the sky band holds only sky tokens (blue-ish or a white cloud); shapes stay below it
        assert set(v[:, :, :sky].unique().tolist()) <= set(world.palette("sky")) | set(
            world.palette("shapes")
        )
    assert w.videos.shape == (40, 4, 32, 32) and w.coarse.shape == (40, 4, 4, 4)


def test_caption_determines_the_video_up_to_textures() -> None:
    # the stage is fixed: a scene's shape cells are exactly the staged scene's of its caption words
    for s in world.generate(30, seed=4).scenes:
        (shape,) = s.shapes
        said = world.Description(
            shape.colour, shape.kind, shape.direction, shape.speed, s.ground, s.cloud is not None
        )
        again = world.staged(said, seed=s.seed + 1)  # other textures
        tok = world.NAMES.index(shape.colour)
        assert torch.equal(world.render(s) == tok, world.render(again) == tok)
        cap = world.caption(s)
        assert (b"cloudy" in cap) == (s.cloud is not None) and (b"sand" in cap) == (
            s.ground == "sand"
        )


def test_training_split_leaves_out_the_heldout_pairs() -> None:
    train = world.generate(300, seed=1, split="train")
    held = world.generate(60, seed=2, split="heldout")
    pairs = lambda w: {(s.shapes[0].colour, s.shapes[0].direction) for s in w.scenes}  # noqa: E731
    assert pairs(train).isdisjoint(world.HELDOUT_PAIRS)
    assert pairs(held) == set(world.HELDOUT_PAIRS)  # 60 draws cover the 4 pairs
    for cap in train.captions:  # no training caption says a held-out colour with its direction
        words = cap.decode().split()
        assert not any(c in words and d in words for c, d in world.HELDOUT_PAIRS), cap
    assert {(s.shapes[0].colour, s.shapes[0].direction) for s in world.generate(300).scenes} & set(
        world.HELDOUT_PAIRS
    )  # the unrestricted world has them
    assert b"yellow" in world.HELDOUT_CAPTION and b"right" in world.HELDOUT_CAPTION
    assert ("yellow", "right") in world.HELDOUT_PAIRS


def test_coarse_is_block_mode() -> None:
    v = torch.zeros(1, 16, 16, dtype=torch.long)
    v[0, :8, :8] = 6
    v[0, :3, :8] = 10  # a minority in the first block
    v[0, 8:, 8:] = 3
    c = world.coarse_of(v)
    assert c.tolist() == [[[6, 0], [0, 3]]]


def test_palette_and_region() -> None:
    assert world.palette("blue-ish") == [0, 1, 2, 3]
    m = world.region("sky", shape=(16, 8))
    assert m.shape == (16, 8) and m[:, :3].all() and not m[:, 3:].any()
    assert (world.region("ground", shape=(16, 8)) == ~m).all()
