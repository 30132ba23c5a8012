"""A small deterministic world to learn from: token videos of moving coloured shapes, with captions.

Each *scene* is ``T`` frames of ``W × H`` tokens over a palette of 16 tokens (:data:`PALETTE`): a sky
band at the top (blue-ish tokens, sometimes a white cloud), a textured ground below the horizon
(grass or sand), and one shape (square, circle, bar) of a bright colour moving left, right, up or
down by one or two cells per frame. The stage is fixed (:func:`layout`: horizon, shape size, the
shape's path centred), so its caption, plain English bytes, says everything but the textures::

    a red square moves left under a blue sky

Some (colour, direction) pairs never occur in the training split (:data:`HELDOUT_PAIRS`): a caption
such as ``a yellow circle moves right`` is new as a whole, though each word is not.

The coarse grid (``÷8``) is the mode token of each 8×8 block (ties: the smallest token id).

Axis convention: a video is indexed ``[t, x, y]`` like ``Vid : Grid3D(T, W, H)`` — ``x`` is the
column, ``y`` the row (``y = 0`` at the top). Images are ``video[t].T`` (rows first).

Everything is a pure function of the seed: :func:`sample_scene` draws with a private
``random.Random``; :func:`render` draws the textures with a ``torch.Generator`` seeded from the
scene. Bound names (see :mod:`lmpm.bindings`): ``Palette`` → :func:`palette`, ``region`` →
:func:`region`.

>>> s = sample_scene(3)
>>> v = render(s)
>>> tuple(v.shape), int(v.min()) >= 0, int(v.max()) < K
((4, 32, 32), True, True)
>>> caption(s) == caption(sample_scene(3)) and bool((render(sample_scene(3)) == v).all())
True
>>> tuple(coarse_of(v).shape)
(4, 4, 4)
>>> palette("blue-ish")
[0, 1, 2, 3]
>>> region("sky", shape=(32, 32))[:, :12].all().item(), region("sky", shape=(32, 32))[:, 12:].any().item()
(True, False)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from torch import Tensor

K = 16  # palette size (tokens 0..15)
BLOCK = 8  # the coarse grid is ÷8

# (name, RGB) per token. Tokens 0-3 are "blue-ish".
PALETTE: tuple[tuple[str, tuple[int, int, int]], ...] = (
    ("sky blue", (110, 170, 235)),
    ("light blue", (165, 208, 245)),
    ("deep blue", (45, 95, 200)),
    ("cyan", (90, 200, 220)),
    ("white", (246, 246, 246)),
    ("grey", (150, 150, 150)),
    ("green", (70, 160, 70)),
    ("dark green", (35, 105, 45)),
    ("brown", (130, 85, 45)),
    ("sand", (222, 200, 130)),
    ("red", (220, 40, 40)),
    ("orange", (240, 140, 30)),
    ("yellow", (245, 220, 50)),
    ("purple", (140, 60, 180)),
    ("pink", (240, 130, 180)),
    ("black", (20, 20, 20)),
)
NAMES = tuple(n for n, _ in PALETTE)
RGB = tuple(c for _, c in PALETTE)

PALETTES: dict[str, tuple[int, ...]] = {
    "blue-ish": (0, 1, 2, 3),
    "sky": (0, 1, 2, 3, 4),
    "ground": (6, 7, 8, 9),
    "shapes": (10, 11, 12, 13, 14, 15),
    "all": tuple(range(K)),
}

SHAPE_COLOURS = ("red", "orange", "yellow", "purple", "pink", "black")
SHAPE_KINDS = ("square", "circle", "bar")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
SKY_FRACTION = (3, 8)  # region("sky"): rows y < H * 3/8; the world's horizon is at or below it


def palette(name: str = "all") -> list[int]:
    """`Palette("blue-ish")`: the token ids of a named palette group."""
    try:
        return list(PALETTES[name])
    except KeyError:
        raise ValueError(f"unknown palette {name!r}; palettes: {', '.join(PALETTES)}") from None


def sky_rows(h: int) -> int:
    """Rows ``y < sky_rows(H)`` are the sky band every scene has."""
    return max(h * SKY_FRACTION[0] // SKY_FRACTION[1], 1)


def region(name: str, *, shape: tuple[int, ...]) -> Tensor:
    """`region("sky")`: bool mask over the ``(W, H)`` axes it stands for (``"ground"``: the rest)."""
    if len(shape) != 2:
        raise ValueError(f"region({name!r}) stands for two axes (x, y); got shape {shape}")
    w, h = int(shape[0]), int(shape[1])
    rows = torch.arange(h) < sky_rows(h)
    if name == "sky":
        m = rows
    elif name == "ground":
        m = ~rows
    else:
        raise ValueError(f"unknown region {name!r}; regions: sky, ground")
    return m[None, :].expand(w, h).clone()


@dataclass(frozen=True, slots=True)
class Shape:
    kind: str  # square | circle | bar
    colour: str  # one of SHAPE_COLOURS
    size: int
    x: int  # top-left corner in frame 0
    y: int
    direction: str  # left | right | up | down
    speed: int  # cells per frame


@dataclass(frozen=True, slots=True)
class Scene:
    seed: int
    T: int = 4
    W: int = 32
    H: int = 32
    horizon: int = 12  # first ground row
    ground: str = "grass"  # grass | sand
    cloud: tuple[int, int, int] | None = None  # (x, y, size) of a white cloud, or none
    shapes: tuple[Shape, ...] = field(default_factory=tuple)


# Held-out (colour, direction) pairs: no training scene has them, so a caption such as "a yellow
# circle moves right" is new to the models as a whole although each word is not (docs/models.md).
HELDOUT_PAIRS: frozenset[tuple[str, str]] = frozenset(
    {("yellow", "right"), ("purple", "left"), ("pink", "down"), ("orange", "up")}
)
SPLITS = ("all", "train", "heldout")


def in_split(colour: str, direction: str, split: str) -> bool:
    """Whether a (colour, direction) pair belongs to ``split`` (``all``, ``train``, ``heldout``)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    held = (colour, direction) in HELDOUT_PAIRS
    return split == "all" or held == (split == "heldout")


def layout(T: int, W: int, H: int) -> tuple[int, int, int]:
    """(horizon, object size, object centre row): the fixed stage every scene is drawn on, so the
    caption says everything but the textures (where the object is follows from what it does)."""
    horizon = min(sky_rows(H) + max(H // 16, 1), H - 2)
    size = max(W * 3 // 16, 3)
    return horizon, size, horizon + max((H - horizon - size) // 2, 0)


def sample_scene(seed: int, T: int = 4, W: int = 32, H: int = 32, split: str = "all") -> Scene:
    """A random scene (pure function of the arguments): one shape whose path the caption fixes
    (colour, kind, direction, speed), on grass or sand, sometimes under a white cloud.

    The shape's path is centred on the stage (:func:`layout`), so a caption determines the video
    up to the texture noise; ``split`` restricts the (colour, direction) pair (:data:`HELDOUT_PAIRS`).
    """
    r = random.Random(seed * 7919 + 17)
    horizon, size, row = layout(T, W, H)
    ground = r.choice(("grass", "grass", "sand"))
    cloud = None
    if ground == "grass" and r.random() < 0.4:
        cs = max(sky_rows(H) * 5 // 12, 3)
        cloud = (W * 5 // 8, max(sky_rows(H) // 6, 0), cs)
    while True:
        colour = r.choice(SHAPE_COLOURS)
        direction = r.choice(tuple(DIRECTIONS))
        if in_split(colour, direction, split):
            break
    speed = 1 if r.random() < 0.7 else 2
    dx, dy = DIRECTIONS[direction]
    travel = speed * (T - 1) // 2  # the path is centred on the stage
    x = (W - size) // 2 - dx * travel
    y = row - dy * travel
    shape = Shape(r.choice(SHAPE_KINDS), colour, size, x, y, direction, speed)
    return Scene(seed, T, W, H, horizon, ground, cloud, (shape,))


def _disc(size: int) -> Tensor:
    c = (size - 1) / 2
    i = torch.arange(size, dtype=torch.float32)
    d = (i[:, None] - c) ** 2 + (i[None, :] - c) ** 2
    return d <= (size / 2) ** 2 + 0.25


def _stamp(kind: str, size: int) -> Tensor:
    """(size_x, size_y) bool footprint of a shape."""
    if kind == "circle":
        return _disc(size)
    if kind == "bar":
        m = torch.zeros(size, size, dtype=torch.bool)
        m[:, size // 3 : size // 3 + max(size // 3, 2)] = True  # wide and flat
        return m
    return torch.ones(size, size, dtype=torch.bool)


def render(scene: Scene) -> Tensor:
    """(T, W, H) int64 tokens."""
    T, W, H = scene.T, scene.W, scene.H
    g = torch.Generator().manual_seed(scene.seed * 104729 + 3)
    bg = torch.zeros(W, H, dtype=torch.int64)
    y = torch.arange(H)[None, :].expand(W, H)
    sky = y < scene.horizon
    noise = torch.rand(W, H, generator=g)
    sky_tok = torch.where(noise < 0.12, 1, 0)
    sky_tok = torch.where((noise > 0.97) & (y < scene.horizon // 2), 2, sky_tok)
    if scene.ground == "grass":
        ground_tok = torch.where(noise < 0.25, 7, 6)
    else:
        ground_tok = torch.where(noise < 0.2, 8, 9)
    bg = torch.where(sky, sky_tok, ground_tok)
    if scene.cloud is not None:
        cx, cy, cs = scene.cloud
        disc = _disc(cs)
        sub = bg[cx : cx + cs, cy : cy + cs]
        d = disc[: sub.shape[0], : sub.shape[1]]
        sub[d] = 4
    out = bg[None].repeat(T, 1, 1)
    for t in range(T):
        for s in scene.shapes:
            dx, dy = DIRECTIONS[s.direction]
            x0, y0 = s.x + dx * s.speed * t, s.y + dy * s.speed * t
            stamp = _stamp(s.kind, s.size)
            xs = torch.arange(s.size) + x0
            ys = torch.arange(s.size) + y0
            inside = ((xs >= 0) & (xs < W))[:, None] & ((ys >= 0) & (ys < H))[None, :] & stamp
            if not bool(inside.any()):
                continue
            ix = xs[:, None].expand_as(inside)[inside]
            iy = ys[None, :].expand_as(inside)[inside]
            out[t, ix, iy] = NAMES.index(s.colour)
    return out


def caption(scene: Scene, style: int = 0) -> bytes:
    """The scene in plain English (lowercase ASCII, ≤ 64 bytes). ``style`` picks a phrasing.

    The ending names what is not texture: a cloud ("under a cloudy blue sky"), sand ("on the
    sand"); a plain grass scene says either "under a blue sky" or "over green grass"."""
    r = random.Random(scene.seed * 31 + style)
    parts = []
    for s in scene.shapes:
        verb = r.choice(("moves", "moves", "goes", "slides")) if len(scene.shapes) == 1 else "goes"
        fast = " fast" if s.speed > 1 and len(scene.shapes) == 1 else ""
        art = "an" if s.colour[0] in "aeiou" else "a"
        parts.append(f"{art} {s.colour} {s.kind} {verb} {s.direction}{fast}")
    what = " and ".join(parts) if len(parts) == 1 else ", ".join(parts)
    if scene.cloud is not None:
        ending = " under a cloudy blue sky"
    elif scene.ground == "sand":
        ending = " on the sand"
    else:
        ending = (" under a blue sky", " over green grass")[r.randrange(2)]
    text = what + ending
    if len(text) > 64:
        text = what
    if len(text) > 64:
        text = text[:64].rsplit(" ", 1)[0]
    return text.encode("ascii")


def coarse_of(video: Tensor, block: int = BLOCK) -> Tensor:
    """The mode token of each ``block × block`` tile: (..., W, H) → (..., W/block, H/block)."""
    *lead, w, h = video.shape
    tiles = video.reshape(*lead, w // block, block, h // block, block)
    tiles = tiles.movedim(-3, -2).reshape(*lead, w // block, h // block, block * block)
    counts = torch.nn.functional.one_hot(tiles, K).sum(-2)  # (..., w/b, h/b, K)
    return counts.argmax(-1)  # first maximum: ties go to the smallest token


@dataclass(frozen=True, slots=True)
class World:
    videos: Tensor  # (n, T, W, H) int64
    coarse: Tensor  # (n, T, W/8, H/8) int64
    captions: tuple[bytes, ...]
    scenes: tuple[Scene, ...]


def generate(
    n: int, seed: int = 0, T: int = 4, W: int = 32, H: int = 32, split: str = "all"
) -> World:
    """``n`` scenes with seeds ``seed*1_000_003 + i`` (disjoint seeds give disjoint worlds);
    ``split="train"`` leaves out the :data:`HELDOUT_PAIRS`, ``"heldout"`` has only them."""
    scenes = tuple(sample_scene(seed * 1_000_003 + i, T, W, H, split) for i in range(n))
    videos = torch.stack([render(s) for s in scenes]) if scenes else torch.zeros(0, T, W, H)
    return World(
        videos.long(),
        coarse_of(videos.long()),
        tuple(caption(s, style=i % 3) for i, s in enumerate(scenes)),
        scenes,
    )


@dataclass(frozen=True, slots=True)
class Description:
    """What a caption says about a scene: its one shape, the ground, whether a cloud floats."""

    colour: str
    kind: str  # one of SHAPE_KINDS
    direction: str  # a key of DIRECTIONS
    speed: int = 1  # cells per frame (2: "fast")
    ground: str = "grass"
    cloud: bool = False


def staged(what: Description, *, seed: int = 2024, T: int = 4, W: int = 32, H: int = 32) -> Scene:
    """The scene a caption describes, on the world's stage (:func:`layout`): what
    :func:`sample_scene` draws for these attributes, with ``seed`` choosing only the textures."""
    horizon, size, row = layout(T, W, H)
    dx, dy = DIRECTIONS[what.direction]
    travel = what.speed * (T - 1) // 2
    shape = Shape(
        what.kind,
        what.colour,
        size,
        (W - size) // 2 - dx * travel,
        row - dy * travel,
        what.direction,
        what.speed,
    )
    cloud = what.cloud
    c = (W * 5 // 8, max(sky_rows(H) // 6, 0), max(sky_rows(H) * 5 // 12, 3)) if cloud else None
    return Scene(seed, T, W, H, horizon, what.ground, c, (shape,))


def demo_scene(T: int = 4, W: int = 32, H: int = 32) -> Scene:
    """The seed's scene (``examples/video/caption.txt``): a red square moves left under a blue sky."""
    return staged(Description("red", "square", "left"), T=T, W=W, H=H)


HELDOUT_CAPTION = b"a yellow circle moves right under a cloudy blue sky"


def heldout_scene(T: int = 4, W: int = 32, H: int = 32) -> Scene:
    """The README demo's scene (``examples/video/heldout/``), a held-out pair
    (:data:`HELDOUT_PAIRS`): :data:`HELDOUT_CAPTION`."""
    return staged(Description("yellow", "circle", "right", cloud=True), T=T, W=W, H=H)
