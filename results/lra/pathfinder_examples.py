"""A grid of generated Pathfinder images (Long Range Arena, 32 x 32, LRA's settings): four of label 1 (the two
markers are the two ends of one path) above four of label 0 (the ends of two different paths), drawn by
:func:`tasks.data.pathfinder.generate_pathfinder` from a fixed seed.

    python results/lra/pathfinder_examples.py                  # writes results/lra/pathfinder_examples.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # a file, never a window
import matplotlib.pyplot as plt  # noqa: E402

from tasks.data.pathfinder import generate_pathfinder, lra_settings  # noqa: E402

PER_LABEL = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=32, help="image side in pixels (LRA: 32; Path-X: 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".png"), help="the PNG to write")
    args = parser.parse_args()
    images = generate_pathfinder(lra_settings(args.resolution), 4 * PER_LABEL, seed=args.seed)
    rows = [[image for image in images if image.label == label][:PER_LABEL] for label in (1, 0)]
    figure, axes = plt.subplots(2, PER_LABEL, figsize=(2 * PER_LABEL, 4.9))
    for row, examples in zip(axes, rows, strict=True):
        for axis, image in zip(row, examples, strict=True):
            axis.imshow(image.pixels, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            axis.set_title(f"label {image.label}: {'one path' if image.label else 'two paths'}", fontsize=9)
            axis.set_axis_off()
    figure.suptitle(f"Pathfinder {args.resolution}x{args.resolution} (LRA settings, seed {args.seed})", fontsize=10)
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
