"""A site's own images: index a folder in a format people already have, label every sample with
its global class id from the run's task plan, and set held-out samples aside.

Three formats (``data_format``; ``auto`` tells them apart by the folder's content, in this order):

* ``hf`` -- a Hugging Face ``datasets`` folder written with ``save_to_disk`` (it holds
  ``dataset_dict.json`` or ``state.json``), read with ``datasets.load_from_disk`` (the optional
  extra ``fcl-flower[hf]``). Images come from the first ``datasets.Image`` column, class names
  from the first ``ClassLabel`` column (its names) or a column ``label`` / ``labels`` / ``class``
  (its values); an optional ``task`` column is checked against the plan. A ``DatasetDict`` uses
  its ``train`` split and, if present, its ``test`` split as the held-out samples.
* ``manifest`` -- ``manifest.csv`` or ``manifest.json`` in the folder (or any file named by the
  caller): one row per image with ``file`` (relative to the folder, or absolute) and ``class``,
  optionally ``task`` (checked against the plan) and ``split`` (``train`` or ``test``: the
  held-out samples are then given). JSON: a list of such objects, or ``{"samples": [...]}``.
* ``imagefolder`` -- ``<dir>/<class-name>/**/*.png|jpg|jpeg``; or split into per-task folders
  ``<dir>/task-<t>/<class-name>/...`` (tasks count from 0, as the run's stages do; each class
  must sit in its task of the plan); held-out samples given as ``<dir>/train/...`` and
  ``<dir>/test/...`` (or class folders next to ``test/``), each of them a tree as above.

Class names are looked up in the run's class list (:class:`~fcl_flower.data.plan.TaskPlan`):
position = global label, so every site agrees on the labels; a class a site does not hold is
fine, a name that is not in the list is an error. Where the held-out samples are not given they
are drawn per class: ``round(test_fraction * n)`` of a class's ``n`` samples (none when n = 1,
never all), chosen by a generator seeded with the run seed and the class name over the samples
sorted by file path (or row), so the same folder gives the same split on every call and machine.

Every file a site reads lies inside its folder (``data-dir``): a manifest row, or a file of an
image folder that is a symbolic link, that resolves outside it is refused naming the row or file,
unless the site opts in (``OwnSettings.files_outside``, node config ``files-outside-data-dir``).
No image larger than :data:`MAX_PIXELS` (40 megapixels; node config ``max-image-pixels``) is
decoded: PIL's decompression-bomb limit is set to it, and its warning made an error, around
every open, so a small file that would decode to gigabytes is one line naming the file.

Images are decoded lazily and converted to the plan's channels (``L`` for 1, ``RGB`` for 3)
and resized (bilinear, aspect ratio not kept) to its height and width; the decoded uint8 arrays
are cached per process up to :data:`CACHE_BYTES`. Every problem a site can fix is one
:class:`~fcl_flower.data.errors.DatasetError` line that names the file or folder: an unknown
class, an unreadable or corrupt image, an empty class or task folder, a class in the wrong task.
Indexing a folder of files also opens every file once (:func:`check_files`), so all of these stop
a site at its first use of the folder, not in a later task. A site stops at its folder's first
problem; a check (``fcl-check-data``) passes a collecting :class:`Problems` and gets them all.
Pure I/O and indexing: nothing here knows about Flower.
"""

from __future__ import annotations

import csv
import json
import re
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from .errors import DatasetError, one_line
from .labelled import LabelledDataset
from .plan import TaskPlan
from .transforms import AUGMENTATIONS, own_transforms

FORMATS = ("auto", "imagefolder", "manifest", "hf")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
MANIFEST_NAMES = ("manifest.csv", "manifest.json")
HF_MARKERS = ("dataset_dict.json", "state.json")
TRAIN, TEST = "train", "test"
TASK_FOLDER = re.compile(r"task-(\d+)")
DEFAULT_TEST_FRACTION = 0.2
#: The most pixels (width x height) of one image a site decodes, unless its node config says
#: otherwise (``max-image-pixels``): 40 megapixels (e.g. 7300 x 5480, more than most cameras).
#: PIL's own default warns from 89 megapixels and refuses only from 179.
MAX_PIXELS = 40_000_000
#: Decoded images (uint8 at the plan's size) kept per process; beyond it images are decoded on use.
CACHE_BYTES = 512 * 2**20
_SUFFIXES_TEXT = "/".join(IMAGE_SUFFIXES)


# ---------------------------------------------------------------------------- problems
@dataclass
class Problems:
    """Where reading a folder puts each problem it finds: raised at once (a site: its first problem
    stops it), or, with ``collect``, kept and the next folder, row or file read, so that a check
    reports every problem of a folder in one run (one line each)."""

    collect: bool = False
    found: list[str] = field(default_factory=list)
    unreadable: set[str] = field(default_factory=set)  # images already reported, not decoded again

    def add(self, err: DatasetError) -> None:
        if not self.collect:
            raise err
        self.found.append(str(err))

    @contextmanager
    def each(self) -> Iterator[None]:
        """Around one item (a class folder, a row, a file): its problem is added, the rest of the
        item skipped and the caller goes on with the next item."""
        try:
            yield
        except DatasetError as err:
            self.add(err)


def _raise() -> Problems:
    return Problems()


# ---------------------------------------------------------------------------- decoding
@contextmanager
def pixel_cap(limit: int) -> Iterator[None]:
    """PIL's decompression-bomb limit set to ``limit`` pixels, its warning an error, for the
    ``with`` body (PIL checks the size from the file's header, before decoding anything). Not
    thread-safe: a site decodes in its handler's thread (data loaders run no worker processes)."""
    previous = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        Image.MAX_IMAGE_PIXELS = limit
        try:
            yield
        finally:
            Image.MAX_IMAGE_PIXELS = previous


def to_plan(image: Image.Image, image_shape: tuple[int, int, int]) -> np.ndarray:
    """``image`` in the plan's channels and size: uint8 ``(H, W)`` (grayscale) or ``(H, W, 3)``."""
    channels, height, width = image_shape
    if image.mode.startswith("I;16") or image.mode == "I":  # 16-bit grayscale (scans, medical images)
        wide = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        image = Image.fromarray((wide >> 8).astype(np.uint8))  # keep the range, not the low byte
    mode = "L" if channels == 1 else "RGB"
    if image.mode != mode:
        image = image.convert(mode)
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BILINEAR)
    array = np.array(image, dtype=np.uint8)
    array.setflags(write=False)
    return array


class PlanImages:
    """An :class:`~fcl_flower.data.labelled.ImageReader` over a site's images: ``read(j)`` decodes
    sample ``j`` (``load(j)``), converts it to the plan's shape and caches the array while the
    cache has room. Decoding errors become one line naming the sample (``names[j]``)."""

    def __init__(
        self,
        names: Sequence[str],
        load: Callable[[int], Image.Image],
        image_shape: tuple[int, int, int],
        max_pixels: int = MAX_PIXELS,
    ) -> None:
        self.names = list(names)
        self._load = load
        self.image_shape = image_shape
        self.max_pixels = max_pixels
        self._cache: dict[int, np.ndarray] = {}
        self._cached_bytes = 0

    def __len__(self) -> int:
        return len(self.names)

    def array(self, j: int) -> np.ndarray:
        hit = self._cache.get(j)
        if hit is not None:
            return hit
        try:
            with pixel_cap(self.max_pixels):
                image = self._load(j)
            try:
                width, height = image.size
                if width * height > self.max_pixels:  # an image PIL had opened before (datasets)
                    raise DatasetError(
                        f"cannot read image {self.names[j]}: {width * height} pixels exceeds the limit of "
                        f"{self.max_pixels} pixels (node config max-image-pixels)"
                    )
                array = to_plan(image, self.image_shape)
            finally:
                image.close()
        except DatasetError:
            raise
        except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
            raise DatasetError(f"cannot read image {self.names[j]}: {one_line(err)}") from None
        if self._cached_bytes + array.nbytes <= CACHE_BYTES:
            self._cache[j] = array
            self._cached_bytes += array.nbytes
        return array

    def read(self, j: int) -> Image.Image:
        return Image.fromarray(self.array(j))

    def preload(self, positions: Iterable[int]) -> None:
        """Decode ``positions`` now, while they fit in the cache: a bad file then stops the work
        before it starts, and the epochs read arrays."""
        for j in positions:
            if self._cached_bytes >= CACHE_BYTES:
                return
            self.array(int(j))


def _open_file(path: Path) -> Image.Image:
    image = Image.open(path)
    try:
        image.load()  # decode now: a truncated file fails here (PIL then closes a one-frame file)
    except BaseException:
        image.close()
        raise
    return image


def check_files(files: Iterable[Path], problems: Problems | None = None, max_pixels: int = MAX_PIXELS) -> None:
    """Open every file and check it without decoding it (PIL's ``verify``: the header, and for PNG
    every chunk's checksum, so a truncated or damaged PNG fails too): a bad file stops the site at
    its first use of the folder, naming the file, rather than in a later task."""
    problems = problems or _raise()
    for path in files:
        try:
            with pixel_cap(max_pixels), Image.open(path) as image:
                image.verify()
        except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
            problems.add(DatasetError(f"cannot read image {path}: {one_line(err)}"))
            problems.unreadable.add(str(path))


def verify_images(
    reader: PlanImages, problems: Problems | None = None, progress: Callable[[int, int], None] | None = None
) -> None:
    """Decode every image once (a corrupt one raises, or is added to ``problems``, naming it);
    images ``problems`` already holds as unreadable are skipped."""
    problems = problems or _raise()
    for j in range(len(reader)):
        if reader.names[j] not in problems.unreadable:
            with problems.each():
                reader.array(j)
        if progress is not None:
            progress(j + 1, len(reader))


# ---------------------------------------------------------------------------- the index
@dataclass
class OwnIndex:
    """Every image of a site: a printable name (the file, or the dataset row), the key its
    held-out draw sorts by, its global label, whether it is held out (None: to be drawn)."""

    root: Path
    format: str
    names: list[str]
    keys: list[str]
    labels: list[int]
    held_out: list[bool | None]
    reader: PlanImages | None = None
    ignored: list[str] | None = None  # files skipped: not images
    notes: list[str] | None = None

    @property
    def given_split(self) -> bool:
        return any(h is not None for h in self.held_out)


class _Collector:
    def __init__(self, root: Path, fmt: str, confined: bool = True) -> None:
        self.index = OwnIndex(root, fmt, [], [], [], [], ignored=[], notes=[])
        self.sources: list[Any] = []
        self.confined = confined  # refuse files that resolve outside root

    def check_inside(self, path: Path, where: str) -> None:
        """DatasetError unless ``path`` (links followed) lies in the site's folder, or the site opted out."""
        if self.confined and not path.resolve().is_relative_to(self.index.root.resolve()):
            raise DatasetError(
                f"{where} is outside the site's folder {self.index.root} (a site that means it sets node "
                "config files-outside-data-dir=true)"
            )

    def add(self, source: Any, name: str, key: str, label: int, held_out: bool | None) -> None:
        self.sources.append(source)
        self.index.names.append(name)
        self.index.keys.append(key)
        self.index.labels.append(label)
        self.index.held_out.append(held_out)


def _label(plan: TaskPlan, name: str, where: str) -> int:
    try:
        return plan.label_of(name)
    except DatasetError as err:
        raise DatasetError(f"{where}: {err}") from None


def _check_task(plan: TaskPlan, task: int, label: int, where: str) -> None:
    last = len(plan.tasks) - 1
    if not 0 <= task <= last:
        raise DatasetError(f"{where}: task {task} is not a task of the run (tasks 0..{last}, counted from 0)")
    planned = plan.task_of_label(label)
    if planned != task:
        raise DatasetError(
            f"{where}: class {plan.class_names[label]!r} is in task {planned} of the run's plan, not task {task}"
        )


# ---------------------------------------------------------------------------- image folders
def _visible(path: Path) -> bool:
    return not path.name.startswith((".", "__"))


def _subdirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and _visible(p))


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_SUFFIXES


def _scan_class(out: _Collector, folder: Path, label: int, held_out: bool | None) -> None:
    files = []
    for path in sorted(folder.rglob("*")):
        hidden = any(part.startswith((".", "__")) for part in path.relative_to(folder).parts)
        if hidden or not path.is_file():
            continue
        if _is_image(path):
            files.append(path)
        else:
            assert out.index.ignored is not None
            out.index.ignored.append(str(path))
    if not files:
        raise DatasetError(f"{folder}: empty class folder (no {_SUFFIXES_TEXT} images); remove it or add images")
    root = out.index.root
    for path in files:
        out.check_inside(path, str(path))
        out.add(path, str(path), path.relative_to(root).as_posix(), label, held_out)


def _scan_tree(
    out: _Collector, base: Path, children: list[Path], plan: TaskPlan, held_out: bool | None, problems: Problems
) -> None:
    """One image tree: class folders, or task-<t> folders of class folders."""
    stray = sorted(p for p in base.iterdir() if p.is_file() and _is_image(p))
    if stray:
        problems.add(DatasetError(f"{stray[0]}: an image outside any class folder (put it in {base}/<class-name>/)"))
    tasks = [c for c in children if TASK_FOLDER.fullmatch(c.name)]
    classes = [c for c in children if not TASK_FOLDER.fullmatch(c.name)]
    if tasks and classes:
        problems.add(
            DatasetError(
                f"{base}: mixes task folders ({tasks[0].name}) and class folders ({classes[0].name}); use one layout"
            )
        )
        return
    if not children:
        problems.add(
            DatasetError(
                f"{base}: no class folders (expected {base}/<class-name>/*.png or {base}/task-0/<class-name>/)"
            )
        )
        return
    if not tasks:
        for folder in classes:
            with problems.each():
                _scan_class(out, folder, _label(plan, folder.name, str(folder)), held_out)
        return
    for task_dir in tasks:
        match = TASK_FOLDER.fullmatch(task_dir.name)
        assert match is not None
        task = int(match.group(1))
        stray = sorted(p for p in task_dir.iterdir() if p.is_file() and _is_image(p))
        if stray:
            problems.add(
                DatasetError(f"{stray[0]}: an image outside any class folder (put it in {task_dir}/<class-name>/)")
            )
        class_dirs = _subdirs(task_dir)
        if not class_dirs:
            problems.add(DatasetError(f"{task_dir}: empty task folder (no class folders); remove it or add images"))
        for folder in class_dirs:
            with problems.each():
                label = _label(plan, folder.name, str(folder))
                _check_task(plan, task, label, str(folder))
                _scan_class(out, folder, label, held_out)


def index_image_folder(
    root: Path, plan: TaskPlan, problems: Problems | None = None, *, confined: bool = True
) -> tuple[OwnIndex, list[Path]]:
    """Index an ImageFolder-style tree (see the module doc); returns the index and the files."""
    problems = problems or _raise()
    out = _Collector(root, "imagefolder", confined)
    top = _subdirs(root)
    names = {p.name for p in top}
    if TEST in names and TRAIN not in names and TEST in plan.class_names:
        raise DatasetError(
            f"{root / TEST}: 'test' is both a class of the run and the held-out folder; "
            f"put the training images under {root / TRAIN}/"
        )
    if TRAIN in names or TEST in names:
        if TRAIN in names:
            for extra in sorted(names - {TRAIN, TEST}):
                problems.add(DatasetError(f"{root / extra}: next to train/ and test/ no other folder is read; move it"))
            given: bool | None = False if TEST in names else None  # train/ alone: held-out drawn
            _scan_tree(out, root / TRAIN, _subdirs(root / TRAIN), plan, given, problems)
        else:
            _scan_tree(out, root, [p for p in top if p.name != TEST], plan, False, problems)
        if TEST in names:
            _scan_tree(out, root / TEST, _subdirs(root / TEST), plan, True, problems)
    else:
        _scan_tree(out, root, top, plan, None, problems)
    return out.index, list(out.sources)


# ---------------------------------------------------------------------------- manifests
FILE_COLUMNS, CLASS_COLUMNS = ("file", "path"), ("class", "label")


def _manifest_rows(path: Path, problems: Problems) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) of every sample of a CSV or JSON manifest; keys lower-cased."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as err:
        raise DatasetError(f"cannot read the manifest {path}: {one_line(err)}") from None
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        rows = []
        for row in reader:
            if None in row:
                problems.add(DatasetError(f"{path} line {reader.line_num}: more values than columns"))
                continue
            rows.append((f"{path} line {reader.line_num}", {(k or "").strip().lower(): v for k, v in row.items()}))
        return rows
    if path.suffix.lower() == ".json":
        try:
            doc = json.loads(text)
        except ValueError as err:
            raise DatasetError(f"cannot read the manifest {path}: {one_line(err)}") from None
        samples = doc.get("samples") if isinstance(doc, dict) else doc
        if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
            raise DatasetError(
                f"manifest {path}: expected a list of objects (file, class, ...) or {{'samples': [...]}}"
            )
        return [(f"{path} entry {i}", {str(k).strip().lower(): v for k, v in s.items()}) for i, s in enumerate(samples)]
    raise DatasetError(f"manifest {path}: expected a .csv or .json file")


def _column(row: dict[str, Any], names: tuple[str, ...]) -> Any:
    for name in names:
        if name in row:
            return row[name]
    return None


def index_manifest(
    root: Path, manifest: Path, plan: TaskPlan, problems: Problems | None = None, *, confined: bool = True
) -> tuple[OwnIndex, list[Path]]:
    """Index the samples a manifest lists (see the module doc)."""
    problems = problems or _raise()
    out = _Collector(root, "manifest", confined)
    rows = _manifest_rows(manifest, problems)
    if not rows and not problems.found:
        raise DatasetError(f"manifest {manifest}: no samples")
    if rows and (_column(rows[0][1], FILE_COLUMNS) is None or _column(rows[0][1], CLASS_COLUMNS) is None):
        where, row = rows[0]  # the columns are missing: one line, not one per row
        raise DatasetError(f"{where}: needs columns file and class (optional: task, split); has {', '.join(row)}")
    seen: dict[Path, str] = {}
    for where, row in rows:
        with problems.each():
            _manifest_row(out, root, plan, where, row, seen)
    if out.index.given_split and any(h is None for h in out.index.held_out):
        problems.add(DatasetError(f"manifest {manifest}: some rows have a split and some not; give every row one"))
    return out.index, list(out.sources)


def _manifest_row(
    out: _Collector, root: Path, plan: TaskPlan, where: str, row: dict[str, Any], seen: dict[Path, str]
) -> None:
    """One manifest row: added to ``out``, or a DatasetError naming the row."""
    file, name = _column(row, FILE_COLUMNS), _column(row, CLASS_COLUMNS)
    if file is None or name is None:
        raise DatasetError(f"{where}: needs columns file and class (optional: task, split); has {', '.join(row)}")
    file, name = str(file).strip(), str(name).strip()
    if not file:
        raise DatasetError(f"{where}: empty file")
    path = Path(file).expanduser()
    path = path if path.is_absolute() else root / path
    out.check_inside(path, f"{where}: {path}")
    if not path.is_file():
        raise DatasetError(f"{where}: {path} does not exist")
    if path in seen:
        raise DatasetError(f"{where}: {path} is listed twice (also at {seen[path]})")
    seen[path] = where
    label = _label(plan, name, where)
    task = row.get("task")
    if task is not None and str(task).strip() != "":
        try:
            task_id = int(str(task).strip())
        except ValueError:
            raise DatasetError(f"{where}: task must be a whole number counted from 0 (got {task!r})") from None
        _check_task(plan, task_id, label, where)
    held_out: bool | None = None
    if "split" in row:
        split = str(row["split"] or "").strip().lower()
        if split not in (TRAIN, TEST):
            raise DatasetError(f"{where}: split must be train or test (got {row['split']!r})")
        held_out = split == TEST
    out.add(path, str(path), file, label, held_out)


# ---------------------------------------------------------------------------- HF datasets
LABEL_COLUMNS = ("label", "labels", "class")


def _hf_columns(features: Any, where: str) -> tuple[str, str, Callable[[Any], str]]:
    """(image column, label column, value -> class name) of a datasets.Features."""
    import datasets

    image = next((k for k, f in features.items() if isinstance(f, datasets.Image)), None)
    if image is None:
        raise DatasetError(f"{where}: no image column (a datasets.Image feature); columns: {', '.join(features)}")
    label = next((k for k, f in features.items() if isinstance(f, datasets.ClassLabel)), None)
    if label is not None:
        names = list(features[label].names)

        def name_of(value: Any) -> str:
            if not isinstance(value, int) or not 0 <= value < len(names):
                raise ValueError(f"label {value!r} is not one of the {len(names)} ClassLabel names")
            return str(names[value])

        return image, label, name_of
    label = next((k for k in LABEL_COLUMNS if k in features), None)
    if label is None:
        raise DatasetError(
            f"{where}: no label column (a ClassLabel feature or a column {'/'.join(LABEL_COLUMNS)}); "
            f"columns: {', '.join(features)}"
        )
    return image, label, lambda value: str(value).strip()


def index_hf(
    root: Path, plan: TaskPlan, problems: Problems | None = None
) -> tuple[OwnIndex, list[tuple[Any, str, int]]]:
    """Index a ``save_to_disk`` folder (see the module doc); sources are (dataset, row)."""
    problems = problems or _raise()
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            f"{root} is a Hugging Face datasets folder: install the datasets library (pip install 'fcl-flower[hf]')"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(root))
    except Exception as err:  # the library raises FileNotFoundError, ValueError, arrow errors...
        raise DatasetError(f"cannot read the datasets folder {root}: {one_line(err)}") from None
    out = _Collector(root, "hf")
    parts: list[tuple[str, Any, bool | None]]
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if TRAIN in loaded:
            parts = [(TRAIN, loaded[TRAIN], False if TEST in loaded else None)]
            if TEST in loaded:
                parts.append((TEST, loaded[TEST], True))
        elif len(splits) == 1:
            parts = [(splits[0], loaded[splits[0]], None)]
        else:
            raise DatasetError(f"{root}: splits {', '.join(splits)}; expected a 'train' split (and optionally 'test')")
        skipped = [s for s in splits if s not in (p[0] for p in parts)]
        if skipped:
            assert out.index.notes is not None
            out.index.notes.append(f"splits not read: {', '.join(skipped)}")
    else:
        parts = [("", loaded, None)]
    for split, ds, held_out in parts:
        where = f"{root}" + (f" (split {split})" if split else "")
        image, label_column, name_of = _hf_columns(ds.features, where)
        labels = list(ds[label_column])
        tasks = list(ds["task"]) if "task" in ds.column_names else None
        images = ds.select_columns([image])
        for row, value in enumerate(labels):
            at = f"{root} ({split + ' ' if split else ''}row {row})"
            with problems.each():
                try:
                    name = name_of(value)
                except ValueError as err:
                    raise DatasetError(f"{at}: {err}") from None
                label = _label(plan, name, at)
                if tasks is not None and tasks[row] is not None and str(tasks[row]).strip() != "":
                    try:
                        task = int(tasks[row])
                    except (TypeError, ValueError):
                        raise DatasetError(
                            f"{at}: task must be a whole number counted from 0 (got {tasks[row]!r})"
                        ) from None
                    _check_task(plan, task, label, at)
                out.add((images, image, row), at, f"{split}/{row:012d}", label, held_out)
    if not out.index.names and not problems.found:
        raise DatasetError(f"{root}: the dataset has no rows")
    return out.index, list(out.sources)


def _hf_image(source: tuple[Any, str, int]) -> Image.Image:
    images, column, row = source
    image = images[row][column]
    if image is None:
        raise DatasetError("no image in this row")
    if not isinstance(image, Image.Image):
        raise DatasetError(f"the image column holds {type(image).__name__}, not images")
    return image


# ---------------------------------------------------------------------------- the data
def held_out_count(n: int, fraction: float) -> int:
    """Held-out samples of a class with ``n`` samples: round(fraction * n), none of a single
    sample, never all."""
    return 0 if n < 2 else min(n - 1, int(np.floor(fraction * n + 0.5)))


def draw_held_out(
    labels: np.ndarray, keys: Sequence[str], class_names: Sequence[str], fraction: float, seed: int
) -> np.ndarray:
    """A boolean mask of held-out samples, drawn per class with a generator seeded by ``seed`` and
    the class name over the class's samples sorted by ``keys``: independent of listing order."""
    mask = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels).tolist():
        positions = np.flatnonzero(labels == label)
        positions = positions[np.argsort([keys[int(p)] for p in positions], kind="stable")]
        rng = np.random.default_rng([seed, zlib.crc32(class_names[label].encode("utf-8"))])
        mask[positions[rng.permutation(len(positions))[: held_out_count(len(positions), fraction)]]] = True
    return mask


@dataclass(frozen=True)
class OwnSettings:
    """How a site reads its folder (its node config) and the run seed of the held-out draw."""

    data_format: str = "auto"
    manifest: str = ""  # a manifest file elsewhere than <dir>/manifest.{csv,json}
    test_fraction: float = DEFAULT_TEST_FRACTION
    augment: str = "auto"
    seed: int = 0
    max_pixels: int = MAX_PIXELS  # the largest image decoded (node config max-image-pixels)
    files_outside: bool = False  # manifest rows / links may leave the folder (files-outside-data-dir)

    def __post_init__(self) -> None:
        if isinstance(self.max_pixels, bool) or not isinstance(self.max_pixels, int) or self.max_pixels < 1:
            raise DatasetError(f"max-image-pixels must be a whole number >= 1 (got {self.max_pixels!r})")
        if not isinstance(self.files_outside, bool):
            raise DatasetError(f"files-outside-data-dir must be true or false (got {self.files_outside!r})")
        if self.data_format not in FORMATS:
            raise DatasetError(f"data-format must be one of {', '.join(FORMATS)} (got {self.data_format!r})")
        if self.augment not in AUGMENTATIONS:
            raise DatasetError(f"augment must be one of {', '.join(AUGMENTATIONS)} (got {self.augment!r})")
        if not 0.0 <= self.test_fraction < 1.0:
            raise DatasetError(f"test-fraction must be in [0, 1) (got {self.test_fraction})")


class OwnData:
    """A site's images as the run sees them: training samples per task, held-out samples of the
    classes seen so far; :class:`LabelledDataset` views over one shared decoder."""

    def __init__(self, index: OwnIndex, plan: TaskPlan, settings: OwnSettings) -> None:
        assert index.reader is not None
        self.index, self.plan, self.settings = index, plan, settings
        self.root = index.root
        labels = np.asarray(index.labels, dtype=np.int64)
        if index.given_split:
            self.held_out = np.asarray([bool(h) for h in index.held_out])
        else:
            self.held_out = draw_held_out(labels, index.keys, plan.class_names, settings.test_fraction, settings.seed)
        self.held_out.setflags(write=False)
        self.task_of = np.asarray([plan.task_of_label(int(y)) for y in labels], dtype=np.int64)
        self.train_transform, self.eval_transform = own_transforms(plan.image_shape, settings.augment)
        self._all = LabelledDataset(index.reader, labels)

    @property
    def labels(self) -> np.ndarray:
        return self._all.targets

    def _task(self, task: int) -> int:
        if not 0 <= task < len(self.plan.tasks):
            raise DatasetError(f"task {task} is not a task of the run (tasks 0..{len(self.plan.tasks) - 1})")
        return task

    def _view(self, mask: np.ndarray, transform: Any) -> LabelledDataset:
        view = self._all.subset(np.flatnonzero(mask)).with_transform(transform)
        assert self.index.reader is not None
        self.index.reader.preload(view.indices)
        return view

    def train(self, task: int, *, eval_transform: bool = False) -> LabelledDataset:
        """The site's training samples of ``task`` (augmenting transforms unless ``eval_transform``)."""
        mask = ~self.held_out & (self.task_of == self._task(task))
        return self._view(mask, self.eval_transform if eval_transform else self.train_transform)

    def test(self, upto_task: int) -> LabelledDataset:
        """The site's held-out samples of every class of tasks ``0..upto_task`` (eval transforms)."""
        mask = self.held_out & (self.task_of <= self._task(upto_task))
        return self._view(mask, self.eval_transform)

    def counts(self) -> list[tuple[int, str, int, int]]:
        """(task, class name, training samples, held-out samples) of every class the site holds."""
        rows = []
        for label in np.unique(self.labels).tolist():
            of = self.labels == label
            rows.append(
                (
                    int(self.plan.task_of_label(label)),
                    self.plan.class_names[label],
                    int((of & ~self.held_out).sum()),
                    int((of & self.held_out).sum()),
                )
            )
        return sorted(rows, key=lambda r: (r[0], self.plan.label_of(r[1])))

    def verify(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Decode every image once (a corrupt file raises, naming it); for checking a folder."""
        assert self.index.reader is not None
        verify_images(self.index.reader, progress=progress)


def detect_format(root: Path, settings: OwnSettings) -> str:
    """The folder's format: the explicit one, else by its content (see the module doc)."""
    if settings.data_format != "auto":
        return settings.data_format
    if settings.manifest:
        return "manifest"
    if any((root / name).is_file() for name in HF_MARKERS):
        return "hf"
    if any((root / name).is_file() for name in MANIFEST_NAMES):
        return "manifest"
    if (root / "meta.json").is_file() and any(root.glob("task-*.npz")):
        raise DatasetError(
            f"{root} is a folder exported by export_partitions (a public dataset's split), not a site's own "
            "images: run it with that dataset, or point data-dir at an image folder"
        )
    return "imagefolder"


def manifest_of(root: Path, settings: OwnSettings) -> Path:
    if settings.manifest:
        path = Path(settings.manifest).expanduser()
        path = path if path.is_absolute() else root / path
        if not path.is_file():
            raise DatasetError(f"manifest {path} does not exist")
        return path
    found = [root / name for name in MANIFEST_NAMES if (root / name).is_file()]
    if len(found) != 1:
        raise DatasetError(
            f"{root}: "
            + ("has both manifest.csv and manifest.json; keep one" if found else "has no manifest.csv or manifest.json")
        )
    return found[0]


def index_folder(root: Path, plan: TaskPlan, settings: OwnSettings, problems: Problems | None = None) -> OwnIndex:
    """Index ``root`` in its format; the index's reader decodes the images lazily. Its problems
    raise (the first), or with a collecting ``problems`` are all added there (what was readable
    is indexed)."""
    if not root.is_dir():
        raise DatasetError(f"data-dir {root} is not a folder")
    fmt = detect_format(root, settings)
    if fmt == "hf":
        index, hf_sources = index_hf(root, plan, problems)
        index.reader = PlanImages(
            index.names, lambda j: _hf_image(hf_sources[j]), plan.image_shape, settings.max_pixels
        )
        return index
    confined = not settings.files_outside
    if fmt == "manifest":
        index, files = index_manifest(root, manifest_of(root, settings), plan, problems, confined=confined)
    else:
        index, files = index_image_folder(root, plan, problems, confined=confined)
    check_files(files, problems, settings.max_pixels)
    index.reader = PlanImages(index.names, lambda j: _open_file(files[j]), plan.image_shape, settings.max_pixels)
    return index


def load_own(root: str | Path, plan: TaskPlan, settings: OwnSettings) -> OwnData:
    """A site's data, indexed once per process (and again when the folder changes)."""
    path = Path(root).expanduser().resolve()
    if not path.is_dir():
        raise DatasetError(f"data-dir {path} is not a folder")
    stamp = [path.stat().st_mtime_ns]
    if settings.manifest:
        manifest = Path(settings.manifest).expanduser()
        manifest = manifest if manifest.is_absolute() else path / manifest
        stamp.append(manifest.stat().st_mtime_ns if manifest.is_file() else 0)
    return _load_own(str(path), plan, settings, tuple(stamp))


@lru_cache(maxsize=4)
def _load_own(path: str, plan: TaskPlan, settings: OwnSettings, _stamp: tuple[int, ...]) -> OwnData:
    return OwnData(index_folder(Path(path), plan, settings), plan, settings)
