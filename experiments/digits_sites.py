"""Three sites with their own image folders, cut from scikit-learn's digits (bundled, offline).

    python experiments/digits_sites.py /tmp/sites

writes ``/tmp/sites/site-0``, ``site-1`` and ``site-2``: 8x8 grayscale PNG files, one folder per
class, named ``zero`` .. ``nine`` -- a stand-in for "each site has a folder of images", used by the
deployment story in docs/federations.md and by tests/test_deployment.py. The sites are deliberately
unlike each other, as real sites are:

* ``site-0`` holds every class, as a plain ``<class-name>/*.png`` tree (its held-out samples are
  drawn by the client with the run seed);
* ``site-1`` holds no class of the second task (four through six) and gives its held-out samples
  itself: ``train/<class-name>/`` and ``test/<class-name>/``;
* ``site-2`` holds six classes only, in per-task folders ``task-<t>/<class-name>/``.

Every digit goes to exactly one site, drawn with a fixed seed and uneven per-site weights, so
the class counts differ from site to site. The run's class list is :data:`CLASS_NAMES`; with
``num-tasks=3 first-task-classes=4`` the tasks are zero..three, four..six and seven..nine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image

CLASS_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
#: The tasks the sites are laid out for (num-tasks=3 first-task-classes=4).
TASKS = (range(4), range(4, 7), range(7, 10))
#: Which classes each site holds (site-1 misses task 1; site-2 holds six classes).
SITE_CLASSES = (tuple(range(10)), (0, 1, 2, 3, 7, 8, 9), (0, 1, 4, 7, 8, 9))
SITE_WEIGHTS = (0.5, 0.3, 0.2)
#: Share of site-1's samples it puts in its own test/ folder.
SITE1_TEST_FRACTION = 0.25
RUN_CONFIG = {
    "dataset": "custom",
    "class-names": ",".join(CLASS_NAMES),
    "num-tasks": 3,
    "first-task-classes": 4,
    "image-size": 8,
    "num-clients": 3,
    "evaluation": "federated",
}


def site_of_each(labels: np.ndarray, seed: int = 0) -> np.ndarray:
    """The site of every sample: drawn among the sites holding its class, weighted unevenly."""
    rng = np.random.default_rng(seed)
    sites = np.empty(len(labels), dtype=np.int64)
    for i, label in enumerate(labels.tolist()):
        holders = [s for s, classes in enumerate(SITE_CLASSES) if label in classes]
        weights = np.asarray([SITE_WEIGHTS[s] for s in holders])
        sites[i] = holders[int(rng.choice(len(holders), p=weights / weights.sum()))]
    return sites


def task_of(label: int) -> int:
    return next(t for t, classes in enumerate(TASKS) if label in classes)


def write_sites(out: Path, seed: int = 0) -> list[Path]:
    """Write the three site folders under ``out``; returns them (site-0, site-1, site-2)."""
    from sklearn.datasets import load_digits  # local import: sklearn is slow to import

    digits = load_digits()
    images = np.rint(digits.images * (255 / 16)).astype(np.uint8)  # 0..16 -> 0..255
    labels = digits.target.astype(np.int64)
    sites = site_of_each(labels, seed)
    held = np.random.default_rng(seed + 1).random(len(labels)) < SITE1_TEST_FRACTION
    folders = [out / f"site-{s}" for s in range(len(SITE_CLASSES))]
    for i, (image, label, site) in enumerate(zip(images, labels.tolist(), sites.tolist(), strict=True)):
        name = CLASS_NAMES[label]
        if site == 0:
            folder = folders[0] / name
        elif site == 1:
            folder = folders[1] / ("test" if held[i] else "train") / name
        else:
            folder = folders[2] / f"task-{task_of(label)}" / name
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").save(folder / f"digit-{i:04d}.png")
    return folders


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write site-0, site-1 and site-2 into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw of samples to sites")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"error: {args.out} is not empty", file=sys.stderr)
        return 2
    for folder in write_sites(args.out, args.seed):
        print(f"{folder}: {sum(1 for _ in folder.rglob('*.png'))} images")
    run = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in RUN_CONFIG.items())
    print(f'run config: "{run}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
