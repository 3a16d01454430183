"""Pathfinder and Path-X (Long Range Arena): are the two markers the two ends of one path?

Linsley et al. 2018, "Learning long-range spatial dependencies with horizontal gated recurrent units" (NeurIPS,
arXiv:1805.08315), generator ``snakes2`` (github.com/drewlinsley/pathfinder, MIT licence), used by Tay et al. 2020
(LRA, arXiv:2011.04006, Sec. 3.2) at 32 x 32 (Pathfinder) and 128 x 128 (Path-X); the image is read row by row,
one token per pixel. Written here from the algorithm (numpy, seeded):

- A path ("snake") is a chain of paddles: line segments of ``paddle_length`` and ``paddle_thickness``. The next
  paddle starts ``2 * margin`` past the end of the last one (margin on each side of their joint); its direction is
  drawn from one-pixel steps around the joint, weighted by ``cos^2(min(turn * continuity, pi / 2))`` and by how
  free its far end is, so a path never bends by 90 degrees / continuity or more in one step. Every paddle keeps
  out a band of ``margin`` around itself: a paddle that would overlap one already drawn (``max(a + b) >= 1.8`` on
  their anti-aliased keep-out masks) is redrawn (3 tries) and the path fails after that. A path ignores only its
  own last paddle; unlike snakes2, the other target path's last paddle counts too, so the two never touch.
- Two target paths of ``contour_length`` paddles grow in turn, the first from a free pixel in the image centre
  (``2 * seed_distance`` from every edge), the second ``seed_distance`` away from it; a failure restarts both.
  Then short distractor paths (``contour_length // 3`` paddles each, ``distractors`` paddles in all) fill the
  image (5 tries each; one that cannot be placed is left out).
- Markers (discs of ``marker_radius``) go on the start of one target path and on the far end of the same path
  (label 1) or of the other path (label 0): both labels show the same two paths and the same marker kinds.
- Anti-aliasing: every shape is drawn on an ``antialias``-times finer grid and each pixel averages its sub-pixels;
  a paddle is scaled to its path contrast, a marker to 1, the image to a maximum of 255.

LRA's settings (``lra_benchmarks/data/pathfinder.py``, the snakes2 wrapper's defaults where it names none) are
:data:`LRA_SETTINGS` and the defaults at 32, 64, 128 and 256; another resolution takes the nearest one's, with
``seed_distance`` and ``marker_radius`` scaled. LRA's sizes: 200,000 images split 80 / 10 / 10. With ``data_dir`` the
module reads a folder of the LRA release instead (:func:`read_lra_folder`).
"""

from __future__ import annotations

import math
import multiprocessing
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.data.base import SPLITS, DataError, Sequences, Split, ZooDataModule, derive_seed, is_count, split_sizes
from tasks.data.tokenize import file_digest

PAD_ID = 256  # pixel tokens are the intensities 0-255 themselves; padding (never needed: one length) is 256
NUM_CLASSES = 2
OVERLAP = 1.8  # snakes2: a paddle is refused where its keep-out mask plus the drawn ones reach this
OCCUPIED = 0.3  # snakes2: a pixel whose keep-out value exceeds this is taken when seeding a path
PADDLE_TRIES = 3  # snakes2's max_paddle_retrial = 2: the first draw and two more
DISTRACTOR_TRIES = 5  # snakes2's max_distractor_contour_retrial = 4
MIN_FREE = 0.01  # snakes2's stop_with_availability: no new distractor once under 1 % of the pixels are free
MAX_IMAGE_TRIES = 1000  # restarts of the two target paths before the settings are declared impossible
MIN_MARKER_RADIUS = 1.0  # a scaled marker never shrinks below a path's width
CHUNK = 500  # images drawn from one seed: the unit of parallel generation
LRA_SPLIT = {"train": 0.8, "val": 0.1, "test": 0.1}  # LRA's input pipeline and the Nystromformer preprocessing


@dataclass(frozen=True)
class SnakeSettings:
    """Every parameter of the generator (the names of snakes2's wrapper where they exist).

    ``paddle_margins``: one margin per image, drawn from these (LRA's Path-X: 2 or 3). ``path_contrast``: a paddle's
    intensity with a marker's as 1 (snakes2's snake contrast x paddle contrast). ``padding``: pixels at each edge no
    paddle enters. ``antialias``: the supersampling factor (1: none)."""

    resolution: int
    contour_length: int
    paddle_length: int
    paddle_margins: tuple[int, ...]
    paddle_thickness: float
    distractors: int
    marker_radius: float
    seed_distance: float
    continuity: float
    padding: int
    path_contrast: float
    antialias: int

    @property
    def distractor_length(self) -> int:
        return max(1, self.contour_length // 3)

    @property
    def num_distractor_paths(self) -> int:
        return self.distractors // self.distractor_length

    def check(self) -> None:
        """ValueError naming the first setting that cannot generate images."""
        counts = {
            "resolution": (self.resolution, 8),
            "contour_length": (self.contour_length, 2),
            "paddle_length": (self.paddle_length, 1),
            "distractors": (self.distractors, 0),
            "padding": (self.padding, 0),
            "antialias": (self.antialias, 1),
        }
        for name, (value, low) in counts.items():
            if not is_count(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not self.paddle_margins or not all(is_count(m) and m >= 1 for m in self.paddle_margins):
            raise ValueError(f"paddle_margin must be an int >= 1 or a list of them, got {list(self.paddle_margins)}")
        for name in ("paddle_thickness", "marker_radius", "seed_distance", "continuity", "path_contrast"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.resolution - 2 * int(2 * self.seed_distance) < 1:
            raise ValueError(
                f"seed_distance={self.seed_distance} leaves no room for the first path, which starts "
                f"2 * seed_distance from every edge of the {self.resolution}-pixel image; use less than "
                f"{(self.resolution + 1) / 4:g}"
            )


#: LRA's snakes2 settings per resolution, from the docstrings of ``lra_benchmarks/data/pathfinder.py`` (paddle length
#: 5, and at 256 padding 22 and seed distance 27, are the snakes2 wrapper's defaults, which LRA does not change there)
LRA_SETTINGS: dict[int, dict[str, Any]] = {
    32: dict(contour_length=14, paddle_length=2, paddle_margins=(1,), paddle_thickness=0.5, distractors=20,
             marker_radius=1.5, seed_distance=7.0, continuity=1.0, padding=1, path_contrast=2 * 0.75, antialias=2),
    64: dict(contour_length=14, paddle_length=5, paddle_margins=(1,), paddle_thickness=1.0, distractors=22,
             marker_radius=2.5, seed_distance=12.0, continuity=1.8, padding=1, path_contrast=0.8, antialias=2),
    128: dict(contour_length=14, paddle_length=5, paddle_margins=(2, 3), paddle_thickness=1.5, distractors=35,
              marker_radius=3.0, seed_distance=20.0, continuity=1.8, padding=1, path_contrast=0.9, antialias=2),
    256: dict(contour_length=14, paddle_length=5, paddle_margins=(3,), paddle_thickness=2.0, distractors=30,
              marker_radius=5.0, seed_distance=27.0, continuity=1.8, padding=22, path_contrast=1.0, antialias=2),
}  # fmt: skip


def lra_settings(resolution: int) -> SnakeSettings:
    """LRA's settings at ``resolution``; another resolution takes those of the nearest LRA resolution (in ratio)
    with ``seed_distance`` and ``marker_radius`` scaled by the ratio (the marker at least one pixel wide)."""
    if not is_count(resolution) or resolution < 8:
        raise ValueError(f"resolution must be an int >= 8, got {resolution!r}")
    nearest = min(LRA_SETTINGS, key=lambda size: abs(math.log(resolution / size)))
    settings = SnakeSettings(resolution=resolution, **LRA_SETTINGS[nearest])
    if nearest == resolution:
        return settings
    ratio = resolution / nearest
    return replace(
        settings,
        seed_distance=settings.seed_distance * ratio,
        marker_radius=max(MIN_MARKER_RADIUS, settings.marker_radius * ratio),
    )


@dataclass(frozen=True)
class PathfinderImage:
    """One generated image and what it was made of; points are ``(row, column)`` in pixels, pixel ``(i, j)``
    centred at ``(i, j)``.

    ``paths``: the two target paths, each ``(contour_length, 2, 2)``: paddle ``k`` runs from ``[k, 0]`` to ``[k, 1]``,
    so a path's ends are ``[0, 0]`` (where it was seeded) and ``[-1, 1]``. ``markers``: ``(2, 2)``, the start of
    ``paths[first]`` and the far end of ``paths[first]`` (label 1) or of ``paths[1 - first]`` (label 0).
    ``distractors``: the distractor paths, each ``(n, 2, 2)``."""

    pixels: np.ndarray  # (resolution, resolution) uint8
    label: int
    paths: tuple[np.ndarray, np.ndarray]
    markers: np.ndarray
    first: int
    distractors: tuple[np.ndarray, ...]


Patch = tuple[int, int, np.ndarray]  # (first row, first column, values): a window of the image


def _unit(angle: float) -> np.ndarray:
    """The unit vector ``(row, column)`` of ``angle`` (radians; 0 = along a row, towards higher columns)."""
    return np.array([math.sin(angle), math.cos(angle)])


class _Canvas:
    """The image being drawn: path intensities, the keep-out mask, and anti-aliased shapes in small windows."""

    def __init__(self, settings: SnakeSettings, margin: int):
        self.s = settings
        self.margin = margin
        size, pad = settings.resolution, settings.padding
        self.image = np.zeros((size, size))
        self.keep_out = np.zeros((size, size))
        if pad:
            self.keep_out[:pad], self.keep_out[-pad:], self.keep_out[:, :pad], self.keep_out[:, -pad:] = 1, 1, 1, 1
        self.sub = (np.arange(settings.antialias) + 0.5) / settings.antialias - 0.5  # sub-pixel centres in a pixel
        self.line_half_width = max(settings.paddle_thickness / 2, 0.5 / settings.antialias)  # never between sub-pixels
        self.keep_half_width = settings.paddle_thickness / 2 + margin
        # candidate directions of the next paddle: one per pixel of arc at its far end (snakes2 samples that circle)
        reach = settings.paddle_length + margin
        self.angles = np.linspace(-math.pi, math.pi, max(8, math.ceil(2 * math.pi * reach)), endpoint=False)
        self.far_ends = reach * np.stack([np.sin(self.angles), np.cos(self.angles)], axis=-1)
        # pixels within `margin` of a pixel: how free a far end is (snakes2 dilates the keep-out mask by a disc)
        span = np.arange(-margin, margin + 1)
        rows, cols = np.meshgrid(span, span, indexing="ij")
        inside = rows**2 + cols**2 <= margin**2
        self.disc = np.stack([rows[inside], cols[inside]], axis=-1)

    def copy(self) -> _Canvas:
        twin = object.__new__(_Canvas)
        twin.__dict__ |= self.__dict__
        twin.image, twin.keep_out = self.image.copy(), self.keep_out.copy()
        return twin

    def coverage(self, a: np.ndarray, b: np.ndarray, half_width: float) -> Patch:
        """The points within ``half_width`` of the segment ``a``-``b`` (a disc where ``a == b``), anti-aliased: each
        pixel holds the share of its ``antialias`` x ``antialias`` sub-pixel centres inside."""
        size = self.s.resolution
        (ay, ax), (by, bx) = a.tolist(), b.tolist()
        r0, c0 = max(0, math.floor(min(ay, by) - half_width)), max(0, math.floor(min(ax, bx) - half_width))
        r1 = min(size - 1, math.ceil(max(ay, by) + half_width))
        c1 = min(size - 1, math.ceil(max(ax, bx) + half_width))
        ys = (np.arange(r0, r1 + 1)[:, None] + self.sub).reshape(-1, 1) - ay
        xs = (np.arange(c0, c1 + 1)[:, None] + self.sub).reshape(1, -1) - ax
        dy, dx = by - ay, bx - ax
        length2 = dy * dy + dx * dx
        if length2 > 0:
            t = np.minimum(np.maximum((ys * dy + xs * dx) / length2, 0.0), 1.0)
            ys, xs = ys - t * dy, xs - t * dx
        inside = (ys * ys + xs * xs <= half_width * half_width).astype(float)
        aa = self.s.antialias
        # numpy's reshape, not einops: this runs ~10^3 times per image and einops' per-call cost would dominate
        values = inside.reshape(r1 - r0 + 1, aa, c1 - c0 + 1, aa).mean(axis=(1, 3))
        return r0, c0, values

    def window(self, patch: Patch) -> np.ndarray:
        r0, c0, values = patch
        return self.keep_out[r0 : r0 + values.shape[0], c0 : c0 + values.shape[1]]

    def keep_out_of(self, a: np.ndarray, b: np.ndarray) -> Patch:
        return self.coverage(a, b, self.keep_half_width)

    def fits(self, patch: Patch, *others: Patch) -> bool:
        """Whether the keep-out mask ``patch`` overlaps neither the canvas's keep-out mask nor ``others``."""
        if others:
            probe = self.copy()
            for other in others:
                probe.block(other)
            return probe.fits(patch)
        return float((self.window(patch) + patch[2]).max()) < OVERLAP

    def block(self, patch: Patch) -> None:
        window = self.window(patch)
        np.maximum(window, patch[2], out=window)

    def draw_paddle(self, a: np.ndarray, b: np.ndarray) -> None:
        r0, c0, values = self.coverage(a, b, self.line_half_width)
        # snakes2 rescales every paddle to its full contrast after anti-aliasing
        values *= self.s.path_contrast / max(float(values.max()), 1e-9)
        window = self.image[r0 : r0 + values.shape[0], c0 : c0 + values.shape[1]]
        np.maximum(window, values, out=window)

    def free_far_ends(self, joint: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The candidate far ends around ``joint`` ``(K, 2)`` and how free each is: ``1 - max`` keep-out within
        ``margin`` of it, 0 outside the image."""
        size = self.s.resolution
        ends = joint + self.far_ends
        outside = ((ends < 0) | (ends > size - 1)).any(axis=-1)
        pixels = np.minimum(np.maximum(np.rint(ends).astype(int)[:, None, :] + self.disc, 0), size - 1)
        taken = self.keep_out[pixels[..., 0], pixels[..., 1]].max(axis=-1)
        return ends, np.where(outside, 0.0, 1.0 - taken)


@dataclass
class _Path:
    """A growing path: its paddles so far and the keep-out mask of the last one, which joins the canvas only once
    the next paddle is placed (consecutive paddles of a path are closer than their margins)."""

    paddles: list[tuple[np.ndarray, np.ndarray]]
    angle: float
    pending: Patch

    def ends(self) -> np.ndarray:
        return np.array([np.stack(paddle) for paddle in self.paddles])


def _paddle_from(canvas: _Canvas, tail: np.ndarray, angle: float) -> tuple[np.ndarray, np.ndarray] | None:
    """The paddle from pixel ``tail`` along ``angle``, or None where its far end leaves the image."""
    head = tail + canvas.s.paddle_length * _unit(angle)
    if (head < 0).any() or (head > canvas.s.resolution - 1).any():
        return None
    return tail.astype(float), head


def _free_tails(canvas: _Canvas, angle: float, border: int) -> np.ndarray:
    """Pixels ``(K, 2)`` at least ``border`` from every edge from which a paddle along ``angle`` overlaps no taken
    pixel (snakes2 dilates the taken pixels by the paddle's keep-out shape)."""
    size = canvas.s.resolution
    centre = np.array([size // 2, size // 2], dtype=float)
    r0, c0, values = canvas.keep_out_of(centre, centre + canvas.s.paddle_length * _unit(angle))
    offsets = np.argwhere(values > OCCUPIED) + [r0 - size // 2, c0 - size // 2]
    reach = int(np.abs(offsets).max())
    taken = np.pad(canvas.keep_out > OCCUPIED, reach, constant_values=True)
    blocked = np.zeros((size, size), dtype=bool)
    for dy, dx in offsets.tolist():
        blocked |= taken[reach + dy : reach + dy + size, reach + dx : reach + dx + size]
    if border:
        blocked[:border], blocked[-border:], blocked[:, :border], blocked[:, -border:] = True, True, True, True
    return np.argwhere(~blocked)


def _start_path(canvas: _Canvas, rng: np.random.Generator, border: int) -> _Path | None:
    """A first paddle from a free pixel in a random direction (3 tries), or None."""
    for _ in range(PADDLE_TRIES):
        angle = rng.uniform(-math.pi, math.pi)
        tails = _free_tails(canvas, angle, border)
        if len(tails) == 0:
            return None
        paddle = _paddle_from(canvas, tails[rng.integers(len(tails))], angle)
        if paddle is not None:
            return _Path([paddle], angle, canvas.keep_out_of(*paddle))
    return None


def _extend(canvas: _Canvas, rng: np.random.Generator, path: _Path, *others: _Path) -> bool:
    """Add one paddle to ``path``, clear of the canvas and of the last paddles of the paths ``others`` growing with
    it; False where none fits (the canvas is then unchanged)."""
    s, margin = canvas.s, canvas.margin
    joint = path.paddles[-1][1] + margin * _unit(path.angle)
    turn = np.abs((canvas.angles - path.angle + math.pi) % (2 * math.pi) - math.pi)
    ends, free = canvas.free_far_ends(joint)
    cumulative = np.cumsum(np.cos(np.minimum(turn * s.continuity, math.pi / 2)) ** 2 * free)
    if cumulative[-1] < 1e-4:
        return False
    for _ in range(PADDLE_TRIES):
        pick = min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), len(ends) - 1)
        angle = float(canvas.angles[pick])
        start = joint + margin * _unit(angle)
        paddle = (start, ends[pick])
        mask = canvas.keep_out_of(*paddle)
        if canvas.fits(mask, *(other.pending for other in others)):
            canvas.block(path.pending)
            path.paddles.append(paddle)
            path.angle, path.pending = angle, mask
            return True
    return False


def _target_paths(canvas: _Canvas, rng: np.random.Generator) -> tuple[_Path, _Path] | None:
    """The two target paths grown in turn from seeds ``seed_distance`` apart, or None (then start again)."""
    s = canvas.s
    first = _start_path(canvas, rng, border=int(2 * s.seed_distance))
    if first is None:
        return None
    second = None
    for _ in range(PADDLE_TRIES):
        offset = s.seed_distance * _unit(rng.uniform(-math.pi, math.pi))
        angle = rng.uniform(-math.pi, math.pi)
        paddle = _paddle_from(canvas, np.rint(first.paddles[0][0] + offset), angle)
        if paddle is not None and canvas.fits(mask := canvas.keep_out_of(*paddle), first.pending):
            second = _Path([paddle], angle, mask)
            break
    if second is None:
        return None
    for _ in range(s.contour_length - 1):
        if not (_extend(canvas, rng, first, second) and _extend(canvas, rng, second, first)):
            return None
    canvas.block(first.pending)
    canvas.block(second.pending)
    return first, second


def _distractor(canvas: _Canvas, rng: np.random.Generator) -> _Path | None:
    """One distractor path drawn on ``canvas`` (5 tries), or None with the canvas unchanged."""
    for _ in range(DISTRACTOR_TRIES):
        if float((canvas.keep_out <= OCCUPIED).mean()) < MIN_FREE:
            return None
        trial = canvas.copy()
        path = _start_path(trial, rng, border=0)
        if path is not None and all(_extend(trial, rng, path) for _ in range(canvas.s.distractor_length - 1)):
            trial.block(path.pending)
            canvas.keep_out = trial.keep_out
            return path
    return None


def generate_image(settings: SnakeSettings, label: int, rng: np.random.Generator) -> PathfinderImage:
    """One Pathfinder image of ``label`` (0 or 1), drawn from ``rng``."""
    for _ in range(MAX_IMAGE_TRIES):
        canvas = _Canvas(settings, margin=int(rng.choice(settings.paddle_margins)))
        targets = _target_paths(canvas, rng)
        if targets is not None:
            break
    else:
        raise ValueError(
            f"could not place two paths of {settings.contour_length} paddles in a {settings.resolution}-pixel image "
            f"in {MAX_IMAGE_TRIES} tries; shorten contour_length or paddle_length, or raise the resolution"
        )
    distractors = [path for _ in range(settings.num_distractor_paths) if (path := _distractor(canvas, rng))]
    paths = (targets[0].ends(), targets[1].ends())
    first = int(rng.integers(2))
    markers = np.stack([paths[first][0, 0], paths[first if label == 1 else 1 - first][-1, 1]])
    # paddles are placed first and drawn once the image is complete (a failed placement draws nothing)
    for path in (*targets, *distractors):
        for paddle in path.paddles:
            canvas.draw_paddle(*paddle)
    image = canvas.image
    for centre in markers:
        r0, c0, values = canvas.coverage(centre, centre, settings.marker_radius)
        window = image[r0 : r0 + values.shape[0], c0 : c0 + values.shape[1]]
        np.maximum(window, values / values.max(), out=window)  # a marker at full contrast, as snakes2 draws it
    pixels = np.rint(image / image.max() * 255).astype(np.uint8)
    return PathfinderImage(pixels, label, paths, markers, first, tuple(path.ends() for path in distractors))


def balanced_labels(count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` labels, ``count // 2`` of them 1 (the rest 0), in a random order."""
    labels = np.zeros(count, dtype=np.int64)
    labels[: count // 2] = 1
    return rng.permutation(labels)


def _generate_chunk(settings: SnakeSettings, labels: np.ndarray, seed: int) -> list[PathfinderImage]:
    rng = np.random.default_rng(seed)
    return [generate_image(settings, int(label), rng) for label in labels]


def generate_pathfinder(settings: SnakeSettings, count: int, seed: int, workers: int = 1) -> list[PathfinderImage]:
    """``count`` images with balanced labels (:func:`balanced_labels`): a pure function of ``settings``, ``count``
    and ``seed``, whatever ``workers`` (processes drawing chunks of :data:`CHUNK` images, each from its own seed)."""
    settings.check()
    if not is_count(workers) or workers < 1:
        raise ValueError(f"workers must be an int >= 1, got {workers!r}")
    labels = balanced_labels(count, np.random.default_rng(derive_seed(seed, "labels")))
    jobs = [
        (settings, labels[at : at + CHUNK], derive_seed(seed, "chunk", at // CHUNK)) for at in range(0, count, CHUNK)
    ]
    if workers == 1 or len(jobs) == 1:
        chunks = [_generate_chunk(*job) for job in jobs]
    else:
        with multiprocessing.Pool(min(workers, len(jobs))) as pool:
            chunks = pool.starmap(_generate_chunk, jobs)
    return [image for chunk in chunks for image in chunk]


def _read_png(path: Path, resolution: int, where: str) -> np.ndarray:
    """The pixels of the grayscale PNG ``path`` as ``(resolution, resolution)`` uint8; :class:`DataError` naming
    ``where`` (its metadata file and line) for an image that is missing, unreadable, not gray or of another size."""
    import matplotlib.image  # only the LRA reader needs it, and it is slow to import

    if not path.is_file():
        raise DataError(f"{where}: image {str(path)!r} does not exist")
    try:
        pixels = matplotlib.image.imread(path)
    except Exception as error:  # any decoder error: the file is not a PNG we can read
        raise DataError(f"{where}: cannot read image {str(path)!r} ({error})") from None
    if pixels.ndim == 3:  # a gray image saved with colour channels (matplotlib's imsave writes RGBA)
        if not (pixels[..., :3] == pixels[..., :1]).all():
            raise DataError(f"{where}: image {str(path)!r} is in colour; Pathfinder images are grayscale")
        pixels = pixels[..., 0]
    if pixels.shape != (resolution, resolution):
        raise DataError(
            f"{where}: image {str(path)!r} is {pixels.shape[0]}x{pixels.shape[1]}, not {resolution}x{resolution}; "
            f"set resolution to the images' size"
        )
    # matplotlib reads 8-bit PNGs as floats k / 255
    return np.rint(pixels * 255).astype(np.uint8) if pixels.dtype.kind == "f" else pixels.astype(np.uint8)


def _metadata_rows(path: Path) -> list[list[str]]:
    """The rows of one metadata file: text lines of space-separated fields, as the LRA release ships them, or a
    NumPy array of strings, as snakes2's ``np.save`` writes them."""
    data = path.read_bytes()
    if data.startswith(b"\x93NUMPY"):
        return [[str(field) for field in row] for row in np.load(path, allow_pickle=False)]
    try:
        return [line.split() for line in data.decode("utf-8").splitlines()]
    except UnicodeDecodeError as error:
        raise DataError(f"{str(path)!r}: neither text nor a NumPy array ({error})") from None


def read_lra_folder(data_dir: Path, resolution: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Images ``(N, resolution * resolution)`` uint8 and labels ``(N,)`` of one difficulty folder of the LRA release
    (e.g. ``lra_release/pathfinder32/curv_contour_length_14``), and the number of empty image files skipped.

    The layout (LRA's ``lra_benchmarks/data/pathfinder.py``): ``metadata/<n>.npy``, read in the order of ``n``, one
    image per line, ``<folder> <file> <index> <label> ...`` naming ``<data_dir>/<folder>/<file>``, e.g.
    ``imgs/0 sample_0.png 0 1 ...``. An empty image file is skipped, as LRA's input pipeline drops it."""
    metadata_dir = data_dir / "metadata"
    files = sorted(metadata_dir.glob("*.npy"), key=lambda f: (int(f.stem) if f.stem.isdigit() else math.inf, f.name))
    if not files:
        found = sorted(str(d.relative_to(data_dir)) for d in data_dir.glob("*/metadata") if d.is_dir())
        hint = f"; these sub-folders have one: {found}" if found else ""
        raise DataError(
            f"no metadata/*.npy in {str(data_dir)!r}: give a folder of the LRA release such as "
            f"pathfinder32/curv_contour_length_14{hint}"
        )
    images, labels, empty = [], [], 0
    for file in files:
        for number, row in enumerate(_metadata_rows(file), start=1):
            if not row:
                continue
            where = f"{str(file)!r} line {number}"
            if len(row) < 4 or row[3] not in ("0", "1"):
                raise DataError(
                    f"{where}: expected '<folder> <file> <index> <label 0 or 1> ...', got {' '.join(row)!r}"
                )
            image = data_dir / row[0] / row[1]
            if image.is_file() and image.stat().st_size == 0:
                empty += 1
                continue
            images.append(_read_png(image, resolution, where).reshape(-1))
            labels.append(int(row[3]))
    if not images:
        raise DataError(f"the metadata in {str(metadata_dir)!r} names no images")
    return np.stack(images), np.array(labels, dtype=np.int64), empty


class PathfinderDataModule(ZooDataModule):
    """Pathfinder (Long Range Arena): does a path join the two markers? One token per pixel, row by row.

    Generated (:func:`generate_pathfinder`, seeded, cached) unless ``data_dir`` names a folder of the LRA release
    (:func:`read_lra_folder`). Tokens are the intensities 0-255, padding 256 (``vocab_size`` 257; every sequence has
    ``resolution ** 2`` tokens, so nothing is padded); labels 0 (different paths) and 1 (one path). Each split is
    drawn from its own seed, so the validation and test sets do not change with ``train_size``; generated labels are
    balanced exactly (half of each split, rounded down, is 1).

    The generator's settings default to LRA's at the resolution (:data:`LRA_SETTINGS`; 32: contour length 14,
    paddle length 2, margin 1, 20 distractor paddles, marker radius 1.5, anti-aliasing 2; Path-X is resolution 128).

    Args:
        resolution: image side in pixels; ``max_seq_len = resolution ** 2`` (LRA: 32, Path-X: 128).
        contour_length: paddles in each of the two target paths (LRA: 14).
        paddle_length: length of a paddle in pixels (LRA at 32: 2).
        paddle_margin: keep-out distance around a paddle in pixels; consecutive paddles are ``2 * margin`` apart. A
            list draws one per image (LRA at 128: [2, 3]).
        distractors: paddles' worth of distractor paths, each ``contour_length // 3`` paddles (LRA at 32: 20).
        marker_radius: radius of the two marker discs in pixels (LRA at 32: 1.5).
        continuity: how straight paths run: a turn of 90 degrees / continuity or more is never taken (LRA at 32:
            1.0, at 128: 1.8).
        seed_distance: distance between the starts of the two target paths in pixels (LRA at 32: 7).
        antialias: supersampling factor of the drawing; 1 draws without anti-aliasing (LRA: 2).
        train_size: training images (None: LRA's 160,000; with ``data_dir``: 80 % of the folder).
        val_size: validation images (None: LRA's 20,000; with ``data_dir``: 10 % of the folder).
        test_size: test images (None: LRA's 20,000; with ``data_dir``: 10 % of the folder).
        workers: processes that generate images; the images do not depend on it.
        data_dir: a difficulty folder of the LRA release (``.../pathfinder32/curv_contour_length_14``, LRA's
            "hard" set): its images are shuffled by ``seed`` and split 80 / 10 / 10 as LRA does; a size given
            above takes the first images of its split. The generator's options are then not used.
        **loader: plus the loader options of :class:`tasks.data.base.ZooDataModule` (``seed``, ``shuffle_seed``,
            ``batch_size``, ``num_workers``, ``pad_to_max_len``, ``cache_dir``).
    """

    target = "sequence"
    cache_name = "pathfinder"

    def __init__(
        self,
        *,
        resolution: int = 32,
        contour_length: int | None = None,
        paddle_length: int | None = None,
        paddle_margin: int | list[int] | None = None,
        distractors: int | None = None,
        marker_radius: float | None = None,
        continuity: float | None = None,
        seed_distance: float | None = None,
        antialias: int | None = None,
        train_size: int | None = None,
        val_size: int | None = None,
        test_size: int | None = None,
        workers: int = 1,
        data_dir: str | None = None,
        **loader: Any,
    ) -> None:
        super().__init__(**loader)
        chosen = {
            "contour_length": contour_length,
            "paddle_length": paddle_length,
            "paddle_margins": None if paddle_margin is None else tuple(np.atleast_1d(paddle_margin).tolist()),
            "distractors": distractors,
            "marker_radius": marker_radius,
            "continuity": continuity,
            "seed_distance": seed_distance,
            "antialias": antialias,
        }
        self.settings = replace(lra_settings(resolution), **{k: v for k, v in chosen.items() if v is not None})
        self.data_dir = None if data_dir is None else Path(data_dir).expanduser().resolve()
        if self.data_dir is None:
            self.settings.check()
        elif not self.data_dir.is_dir():
            raise DataError(f"data_dir {str(self.data_dir)!r} is not a folder")
        given = {"train": train_size, "val": val_size, "test": test_size}
        if self.data_dir is None:
            defaults = {split: round(share * 200_000) for split, share in LRA_SPLIT.items()}
            self.sizes = split_sizes(*(defaults[split] if given[split] is None else given[split] for split in SPLITS))
        else:
            for split, size in given.items():
                if size is not None and (not is_count(size) or size < 1):
                    raise ValueError(f"{split}_size must be an int >= 1 or None, got {size!r}")
            self.sizes = given
        if not is_count(workers) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        self.workers = workers
        self.resolution = resolution
        self.expose(vocab_size=PAD_ID + 1, max_seq_len=resolution**2, num_classes=NUM_CLASSES, pad_id=PAD_ID)

    def cache_params(self) -> dict:
        if self.data_dir is None:
            return {"settings": asdict(self.settings), "sizes": self.sizes, "seed": self.seed}
        metadata = sorted((self.data_dir / "metadata").glob("*.npy"))
        source = {"data_dir": str(self.data_dir), "metadata": file_digest(metadata)}
        return {"resolution": self.resolution, "sizes": self.sizes, "seed": self.seed, **source}

    def build_split(self, split: Split) -> Sequences:
        if self.data_dir is None:
            images = generate_pathfinder(
                self.settings, self.sizes[split], derive_seed(self.seed, "pathfinder", split), self.workers
            )
            pixels = np.stack([image.pixels.reshape(-1) for image in images])
            labels = np.array([image.label for image in images], dtype=np.int64)
        else:
            pixels, labels = self._read_split(split)
        tokens = torch.from_numpy(pixels)
        return Sequences.from_tensors(list(tokens), torch.from_numpy(labels))

    def _read_split(self, split: Split) -> tuple[np.ndarray, np.ndarray]:
        pixels, labels, empty = read_lra_folder(self.data_dir, self.resolution)
        if empty:
            warnings.warn(f"skipped {empty} empty image files in {str(self.data_dir)!r}, as LRA does", stacklevel=2)
        order = np.random.default_rng(derive_seed(self.seed, "pathfinder", "order")).permutation(len(labels))
        bounds = np.cumsum([0, *(round(share * len(labels)) for share in LRA_SPLIT.values())])
        bounds[-1] = len(labels)
        start, stop = bounds[SPLITS.index(split)], bounds[SPLITS.index(split) + 1]
        size = self.sizes[split]
        if size is not None:
            if size > stop - start:
                raise DataError(
                    f"{split}_size={size} but the {split} split of {str(self.data_dir)!r} has {stop - start} images"
                )
            stop = start + size
        chosen = order[start:stop]
        return pixels[chosen], labels[chosen]
