"""Tests of the class-incremental data layer (fcl_flower.data), all offline and fast."""

from __future__ import annotations

import pickle
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fcl_flower.data.download as download_mod
from fcl_flower.data import (
    DATASETS,
    DatasetError,
    FederatedSplit,
    LabelledDataset,
    SyntheticSpec,
    class_order,
    dirichlet_partition,
    get_federated_split,
    load_dataset,
    make_synthetic,
    task_class_ranges,
)
from fcl_flower.data.digits import digits_arrays
from fcl_flower.data.synthetic import synthetic_arrays
from fcl_flower.data.transforms import cifar_transforms, vit_transforms


def _labels(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    """Class-balanced labels in a shuffled order (positions must not follow classes)."""
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def _assert_one_line_error(exc: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(exc.value)
    assert isinstance(exc.value, ValueError)
    assert "\n" not in msg and msg.strip() == msg and msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def _reference_partition(labels, num_clients, beta, rng, min_size=1):
    """The STSA code's procedure, written literally from docs/methods/stsa.md §1.2 with python lists."""
    n = len(labels)
    while True:
        batches = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            idx_c = rng.permutation(np.where(labels == c)[0])
            p = rng.dirichlet(np.repeat(beta, num_clients))
            p = np.array([pk * (len(b) < n / num_clients) for pk, b in zip(p, batches)])
            p = p / p.sum()
            cuts = (np.cumsum(p) * len(idx_c)).astype(int)[:-1]
            batches = [b + piece.tolist() for b, piece in zip(batches, np.split(idx_c, cuts))]
        if min(len(b) for b in batches) >= min_size:
            break
    out = []
    for b in batches:
        arr = np.array(b, dtype=np.int64)
        rng.shuffle(arr)
        out.append(arr)
    return out


# --------------------------------------------------------------------------------------------
# Dirichlet partition
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.05, 0.5, 5.0])
@pytest.mark.parametrize("num_clients", [1, 5, 13])
def test_partition_is_disjoint_complete_and_preserves_classes(beta, num_clients):
    labels = _labels(7, 30, seed=3)
    parts = dirichlet_partition(labels, num_clients, beta, np.random.default_rng(11))
    assert len(parts) == num_clients
    allidx = np.concatenate(parts)
    assert allidx.dtype == np.int64
    assert len(allidx) == len(labels) == len(np.unique(allidx))  # no duplicates, nothing lost
    np.testing.assert_array_equal(np.sort(allidx), np.arange(len(labels)))
    np.testing.assert_array_equal(np.bincount(labels[allidx]), np.bincount(labels))
    assert min(len(p) for p in parts) >= 1


def test_partition_equals_literal_spec_procedure():
    labels = _labels(6, 25, seed=1)
    for beta, k, seed in [(0.1, 5, 0), (0.5, 4, 1), (1.0, 10, 2), (100.0, 3, 3)]:
        ours = dirichlet_partition(labels, k, beta, np.random.default_rng(seed))
        ref = _reference_partition(labels, k, beta, np.random.default_rng(seed))
        for a, b in zip(ours, ref):
            np.testing.assert_array_equal(a, b)


def test_partition_respects_balancing_cap():
    """A client gets samples of class c only if it held < N/K samples before class c.

    The one exception is the code's rounding artefact: cuts are floor(cumsum(p) * n_c) and the
    last client takes the remainder, so when cumsum(p) ends just below 1.0 a capped *last*
    client receives a single sample.
    """
    labels = _labels(10, 40, seed=5)
    n, k = len(labels), 5
    for seed in range(8):
        parts = dirichlet_partition(labels, k, 0.3, np.random.default_rng(seed))
        counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])  # (K, C)
        before = np.cumsum(counts, axis=1) - counts  # size before each class was dealt
        violation = (counts > 0) & (before >= n / k)
        assert not violation[:-1].any()
        assert np.all(counts[-1][violation[-1]] == 1)
        assert (counts * (before >= n / k)).sum() <= labels.max() + 1  # at most one per class


def test_partition_clients_are_shuffled_not_grouped_by_class():
    labels = np.repeat(np.arange(5), 40)  # sorted input: unshuffled output would be sorted
    parts = dirichlet_partition(labels, 3, 100.0, np.random.default_rng(0))
    assert any(np.any(np.diff(labels[p]) < 0) for p in parts)


def _mean_client_entropy(labels, num_clients, beta, seeds):
    vals = []
    for s in seeds:
        for p in dirichlet_partition(labels, num_clients, beta, np.random.default_rng(s)):
            q = np.bincount(labels[p], minlength=labels.max() + 1) / len(p)
            q = q[q > 0]
            vals.append(-(q * np.log(q)).sum())
    return float(np.mean(vals))


def test_smaller_beta_gives_more_label_skew():
    labels = _labels(10, 60, seed=2)
    seeds = range(8)
    h = {b: _mean_client_entropy(labels, 5, b, seeds) for b in (0.1, 1.0, 100.0)}
    assert h[0.1] < h[1.0] < h[100.0] <= np.log(10) + 1e-12
    assert h[100.0] > 0.95 * np.log(10)  # near-uniform clients for large beta
    assert h[1.0] - h[0.1] > 0.2 and h[100.0] - h[1.0] > 0.2  # measurably ordered


def test_partition_reproducible_and_seed_dependent():
    labels = _labels(8, 20)
    a = dirichlet_partition(labels, 4, 0.5, np.random.default_rng(7))
    b = dirichlet_partition(labels, 4, 0.5, np.random.default_rng(7))
    c = dirichlet_partition(labels, 4, 0.5, np.random.default_rng(8))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(num_clients=3, beta=0.0), "beta"),
        (dict(num_clients=3, beta=-1.0), "beta"),
        (dict(num_clients=3, beta=float("nan")), "beta"),
        (dict(num_clients=0, beta=0.5), "num_clients"),
        (dict(num_clients=41, beta=0.5), "41 clients"),
        (dict(num_clients=3, beta=0.5, min_size=20), "min_size"),
    ],
)
def test_partition_bad_inputs(kwargs, needle):
    with pytest.raises(DatasetError) as exc:
        dirichlet_partition(_labels(4, 10), rng=np.random.default_rng(0), **kwargs)
    _assert_one_line_error(exc, needle)


def test_partition_retry_loop_is_capped():
    labels = _labels(2, 5)  # 10 samples, 5 clients, 2 each needed: (practically) never with beta=0.01
    with pytest.raises(DatasetError) as exc:
        dirichlet_partition(labels, 5, 0.01, np.random.default_rng(0), min_size=2, max_attempts=5)
    _assert_one_line_error(exc, "5 attempts", "larger beta")


# --------------------------------------------------------------------------------------------
# Task split
# --------------------------------------------------------------------------------------------
def test_task_ranges_equal_and_large_first_task():
    eq = task_class_ranges(100, 10)
    assert [len(r) for r in eq] == [10] * 10
    big = task_class_ranges(100, 11, first_task_classes=50)
    assert [len(r) for r in big] == [50] + [5] * 10
    for ranges in (eq, big, task_class_ranges(7, 1), task_class_ranges(12, 4, first_task_classes=3)):
        flat = [c for r in ranges for c in r]
        assert flat == list(range(ranges[-1].stop))  # consecutive, disjoint, complete
    assert [len(r) for r in task_class_ranges(12, 4, first_task_classes=3)] == [3, 3, 3, 3]
    assert task_class_ranges(10, 1, first_task_classes=10) == [range(10)]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((10, 0), "num_tasks"),
        ((10, 11), "exceeds num_classes"),
        ((10, 3), "do not divide"),
        ((100, 10, 54), "remaining 46 classes"),
        ((10, 3, 11), "exceeds num_classes"),
        ((10, 5, 8), "only 2 remain"),
        ((10, 3, -1), "first_task_classes"),
        ((10, 1, 4), "num_tasks=1"),
    ],
)
def test_task_ranges_bad_inputs(args, needle):
    with pytest.raises(DatasetError) as exc:
        task_class_ranges(*args)
    _assert_one_line_error(exc, needle)


# --------------------------------------------------------------------------------------------
# Datasets: class order, remapping, digits, synthetic, offline errors
# --------------------------------------------------------------------------------------------
def test_class_order_is_seeded_permutation():
    a, b, c = class_order(100, 0), class_order(100, 0), class_order(100, 1)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.sort(a), np.arange(100))
    assert not np.array_equal(a, c)
    np.testing.assert_array_equal(a, np.random.default_rng(0).permutation(100))


def test_digits_bundle_shapes_and_remapped_targets():
    b = load_dataset("digits", seed=3)
    assert b.num_classes == 10 and b.image_shape == (1, 8, 8)
    assert len(b.train) + len(b.test) == 1797
    assert len(b.train_eval) == len(b.train)
    x, y = b.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and isinstance(y, int)
    xs, ys = b.test.tensors()
    assert xs.shape == (len(b.test), 1, 8, 8) and float(xs.min()) >= 0 and float(xs.max()) <= 1
    # remapping: original label = class_order[position]
    _x_tr, y_tr, _x_te, y_te = digits_arrays()
    np.testing.assert_array_equal(b.class_order[b.train.targets], y_tr)
    np.testing.assert_array_equal(b.class_order[ys.numpy()], y_te)
    np.testing.assert_array_equal(b.class_order, class_order(10, 3))
    # stratified split: every class has ~25% of its samples in the test set
    frac = np.bincount(y_te) / (np.bincount(y_te) + np.bincount(y_tr))
    assert np.all(np.abs(frac - 0.25) < 0.02)
    # cached: the same bundle object for the same arguments
    assert load_dataset("digits", seed=3) is b


def test_synthetic_is_deterministic_and_class_dependent():
    spec = SyntheticSpec(num_classes=6, train_per_class=20, test_per_class=7, channels=3, size=5)
    b1, b2 = make_synthetic(spec, seed=1), make_synthetic(spec, seed=1)
    assert b1.image_shape == (3, 5, 5) and b1.num_classes == 6
    np.testing.assert_array_equal(b1.train.tensors()[0], b2.train.tensors()[0])
    assert np.all(np.bincount(b1.train.targets) == 20) and np.all(np.bincount(b1.test.targets) == 7)
    # images depend on the class: nearest class mean (fitted on train) classifies test well
    xtr, ytr = b1.train.tensors()
    xte, yte = b1.test.tensors()
    means = torch.stack([xtr[ytr == c].mean(0) for c in range(6)]).flatten(1)
    pred = torch.cdist(xte.flatten(1), means).argmin(1)
    assert (pred == yte).float().mean() > 0.9
    # a different data seed gives different images; the class order follows `seed` only
    other = synthetic_arrays(
        SyntheticSpec(num_classes=6, train_per_class=20, test_per_class=7, channels=3, size=5, data_seed=1)
    )
    assert not np.allclose(other[0], synthetic_arrays(spec)[0])
    assert not np.array_equal(make_synthetic(spec, seed=2).class_order, b1.class_order)
    assert load_dataset("synthetic").num_classes == 20


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(DatasetError) as exc:
        load_dataset("mnist")
    _assert_one_line_error(exc, *DATASETS)


@pytest.mark.parametrize(
    ("name", "folder", "url"),
    [
        ("cifar100", "cifar-100-python", "cifar-100-python.tar.gz"),
        ("tiny-imagenet", "tiny-imagenet-200", "tiny-imagenet-200.zip"),
        ("imagenet-r", "imagenet-r", "imagenet-r.tar"),
    ],
)
def test_missing_folder_without_download_is_actionable(tmp_path, name, folder, url):
    with pytest.raises(DatasetError) as exc:
        load_dataset(name, root=tmp_path, download=False)
    _assert_one_line_error(exc, str(tmp_path / folder), url, "download=True")


def test_failed_download_is_one_clean_line(tmp_path, monkeypatch):
    def offline(url, root):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution\nmore lines")

    monkeypatch.setattr(download_mod, "download_archive", offline)
    for name in ("tiny-imagenet", "imagenet-r"):
        with pytest.raises(DatasetError) as exc:
            load_dataset(name, root=tmp_path, download=True)
        _assert_one_line_error(exc, "download of", "URLError", "expected folder")
        assert exc.value.__suppress_context__  # no chained torchvision/urllib traceback

    import torchvision.datasets

    class OfflineCIFAR:
        def __init__(self, *a, **k):
            raise urllib.error.URLError("no network")

    monkeypatch.setattr(torchvision.datasets, "CIFAR100", OfflineCIFAR)
    with pytest.raises(DatasetError) as exc:
        load_dataset("cifar100", root=tmp_path, download=True)
    _assert_one_line_error(exc, "cifar100", "download of", "cifar-100-python")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_image_size(bad):
    with pytest.raises(DatasetError) as exc:
        load_dataset("digits", image_size=bad)
    _assert_one_line_error(exc, "image_size")


def test_digits_resized_for_large_models():
    b = load_dataset("digits", image_size=16)
    assert b.image_shape == (1, 16, 16) and b.train[0][0].shape == (1, 16, 16)


# --------------------------------------------------------------------------------------------
# Image-folder datasets on tiny fake folders (real parsing code, no download)
# --------------------------------------------------------------------------------------------
_COLOURS = [(230, 10, 10), (10, 230, 10), (10, 10, 230)]


def _solid(path: Path, cls: int, size: int = 64) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), _COLOURS[cls]).save(path)


def _dominant_channel(ds: LabelledDataset, i: int) -> int:
    return int(ds[i][0].mean(dim=(1, 2)).argmax())


def test_tiny_imagenet_folder_layout(tmp_path):
    base = tmp_path / "tiny-imagenet-200"
    wnids = ["n02", "n01", "n03"]  # class id = index in sorted wnids
    (base).mkdir()
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    ann = []
    for w in wnids:
        c = sorted(wnids).index(w)
        for j in range(4):
            _solid(base / "train" / w / "images" / f"{w}_{j}.JPEG", c)
        for j in range(2):
            name = f"val_{w}_{j}.JPEG"
            _solid(base / "val" / "images" / name, c)
            ann.append(f"{name}\t{w}\t0\t0\t63\t63")
    (base / "val" / "val_annotations.txt").write_text("\n".join(ann) + "\n")

    b = load_dataset("tiny-imagenet", root=tmp_path, download=False, seed=1)
    assert b.num_classes == 3 and b.image_shape == (3, 64, 64)
    assert len(b.train) == 12 and len(b.test) == 6
    raw_train, raw_test = b.train.with_transform(None), b.test.with_transform(None)
    for ds in (raw_train, raw_test):
        for i in range(len(ds)):
            assert _dominant_channel(ds, i) == b.class_order[ds.targets[i]]
    x, _ = b.train[0]
    assert x.shape == (3, 64, 64) and b.test[0][0].shape == (3, 64, 64)
    assert (base / "fcl_cache" / "train_x.npy").is_file()  # decoded once, cached
    from fcl_flower.data import tiny_imagenet as tiny_mod

    first = tiny_mod._load_arrays(str(base.resolve()))
    tiny_mod._load_arrays.cache_clear()  # a fresh process: arrays come from the .npy cache
    again = tiny_mod._load_arrays(str(base.resolve()))
    assert isinstance(again[0], np.memmap)
    for a, c in zip(first[:4], again[:4]):
        np.testing.assert_array_equal(a, c)


def test_imagenet_r_raw_folder_split_and_prepared_folder(tmp_path):
    raw = tmp_path / "raw" / "imagenet-r"
    sizes = {"n_a": 10, "n_b": 5, "n_c": 2}
    for c, (name, n) in enumerate(sorted(sizes.items())):
        for j in range(n):
            _solid(raw / name / f"{j}.jpg", c, size=20)
    b = load_dataset("imagenet-r", root=tmp_path / "raw", download=False, image_size=24)
    assert b.num_classes == 3 and b.image_shape == (3, 24, 24)
    assert b.train[0][0].shape == (3, 24, 24) and b.test[0][0].shape == (3, 24, 24)
    tr_counts = np.bincount(b.class_order[b.train.targets], minlength=3)
    te_counts = np.bincount(b.class_order[b.test.targets], minlength=3)
    np.testing.assert_array_equal(tr_counts, [8, 4, 1])
    np.testing.assert_array_equal(te_counts, [2, 1, 1])
    raw_test = b.test.with_transform(None)
    assert all(_dominant_channel(raw_test, i) == b.class_order[raw_test.targets[i]] for i in range(len(raw_test)))

    prep = tmp_path / "prep" / "imagenet-r"
    for c, name in enumerate(["x", "y"]):
        for j in range(3):
            _solid(prep / "train" / name / f"{j}.png", c, size=8)
        _solid(prep / "test" / name / "0.png", c, size=8)
    p = load_dataset("imagenet-r", root=tmp_path / "prep", download=False, image_size=16)
    assert p.num_classes == 2 and len(p.train) == 6 and len(p.test) == 2


# --------------------------------------------------------------------------------------------
# LabelledDataset views
# --------------------------------------------------------------------------------------------
def test_labelled_dataset_views_and_transforms():
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, size=(10, 32, 32, 3), dtype=np.uint8)
    ds = LabelledDataset(imgs, np.arange(10) % 4)
    sub = ds.subset(np.array([9, 2, 5])).subset(np.array([2, 0]))
    np.testing.assert_array_equal(sub.indices, [5, 9])
    np.testing.assert_array_equal(sub.targets, [1, 1])
    x, y = sub[1]
    assert y == 1 and torch.allclose(x, torch.from_numpy(imgs[9]).permute(2, 0, 1).float() / 255)
    train_tf, eval_tf = cifar_transforms()
    assert sub.with_transform(train_tf)[0][0].shape == (3, 32, 32)
    vit_train, vit_eval = vit_transforms(40)
    assert ds.with_transform(vit_train)[0][0].shape == (3, 40, 40)
    assert ds.with_transform(vit_eval)[0][0].shape == (3, 40, 40)
    assert sub.with_transform(eval_tf).indices is not None and len(sub.with_transform(eval_tf)) == 2
    with pytest.raises(ValueError):
        sub.targets[0] = 3  # read-only labels
    with pytest.raises(DatasetError):
        ds.subset(np.array([10]))
    clone = pickle.loads(pickle.dumps(sub.with_transform(eval_tf)))  # DataLoader workers / Ray
    assert torch.equal(clone[0][0], sub.with_transform(eval_tf)[0][0])


# --------------------------------------------------------------------------------------------
# Federated split
# --------------------------------------------------------------------------------------------
def _synthetic_split(seed=0, beta=0.5, num_tasks=4, first=0, clients=5):
    bundle = make_synthetic(SyntheticSpec(num_classes=20, train_per_class=30, test_per_class=5), seed=seed)
    return FederatedSplit(bundle, num_tasks, first, clients, beta, seed)


def test_federated_split_disjoint_complete_and_task_labels():
    s = _synthetic_split()
    y = s.bundle.train.targets
    seen = []
    for t, r in enumerate(s.tasks):
        task_idx = np.flatnonzero((y >= r.start) & (y < r.stop))
        parts = [s.client_indices(t, k) for k in range(s.num_clients)]
        allidx = np.concatenate(parts)
        assert len(allidx) == len(np.unique(allidx))
        np.testing.assert_array_equal(np.sort(allidx), task_idx)
        np.testing.assert_array_equal(np.unique(y[allidx]), np.arange(r.start, r.stop))  # exactly its range
        np.testing.assert_array_equal(s.label_counts(t).sum(0), np.bincount(y[task_idx] - r.start))
        for k in range(s.num_clients):
            local = s.client_train(t, k)
            np.testing.assert_array_equal(local.targets, y[s.client_indices(t, k)])
            assert local.transform is s.bundle.train.transform
            assert s.client_train(t, k, eval_transform=True).transform is s.bundle.train_eval.transform
        np.testing.assert_array_equal(s.task_train(t).indices, task_idx)
        seen.append(allidx)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(len(y)))  # every sample once


def test_federated_partition_is_per_task_seeded():
    s = _synthetic_split(seed=4, beta=0.3)
    y = s.bundle.train.targets
    for t, r in enumerate(s.tasks):
        task_idx = np.flatnonzero((y >= r.start) & (y < r.stop))
        direct = dirichlet_partition(y[task_idx], s.num_clients, 0.3, np.random.default_rng([4, t]))
        for k in range(s.num_clients):
            np.testing.assert_array_equal(s.client_indices(t, k), task_idx[direct[k]])
    # tasks get different client-by-class patterns (unlike the STSA code's reseeding)
    assert not np.array_equal(s.label_counts(0), s.label_counts(1))


def test_federated_split_reproducible_and_seed_dependent():
    a, b, c = _synthetic_split(seed=1), _synthetic_split(seed=1), _synthetic_split(seed=2)
    np.testing.assert_array_equal(a.bundle.class_order, b.bundle.class_order)
    assert all(np.array_equal(a.client_indices(t, k), b.client_indices(t, k)) for t in range(4) for k in range(5))
    assert not np.array_equal(a.bundle.class_order, c.bundle.class_order)
    assert not all(np.array_equal(a.client_indices(0, k), c.client_indices(0, k)) for k in range(5))


def test_federated_test_views_and_first_task_split():
    s = _synthetic_split(num_tasks=5, first=8)  # 8 + 4 x 3 classes
    assert [len(r) for r in s.tasks] == [8, 3, 3, 3, 3]
    yt = s.bundle.test.targets
    for t in range(5):
        n = s.num_seen_classes(t)
        assert n == 8 + 3 * t
        seen = s.seen_test(t)
        np.testing.assert_array_equal(np.unique(seen.targets), np.arange(n))
        assert len(seen) == np.sum(yt < n) == sum(len(s.task_test(u)) for u in range(t + 1))
        np.testing.assert_array_equal(np.unique(s.task_test(t).targets), np.arange(s.tasks[t].start, s.tasks[t].stop))


def test_get_federated_split_is_cached_and_matches_direct_build():
    a = get_federated_split("digits", None, False, 0, 5, 0, 5, 0.5)
    assert get_federated_split("digits", None, False, 0, 5, 0, 5, 0.5) is a
    direct = FederatedSplit(load_dataset("digits", seed=0), 5, 0, 5, 0.5, 0)
    for t in range(5):
        for k in range(5):
            np.testing.assert_array_equal(a.client_indices(t, k), direct.client_indices(t, k))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(num_tasks=4, clients=200), "num_clients=200"),  # 150 samples per task
        (dict(num_tasks=21), "exceeds num_classes"),
        (dict(num_tasks=4, beta=0.0), "beta"),
        (dict(num_tasks=4, beta=-0.5), "beta"),
        (dict(num_tasks=3), "do not divide"),
    ],
)
def test_federated_split_bad_inputs(kwargs, needle):
    with pytest.raises(DatasetError) as exc:
        _synthetic_split(**kwargs)
    _assert_one_line_error(exc, needle)


def test_federated_split_bad_task_or_client():
    s = _synthetic_split()
    for call in (lambda: s.client_indices(4, 0), lambda: s.client_indices(0, 5), lambda: s.seen_test(-1)):
        with pytest.raises(DatasetError) as exc:
            call()
        _assert_one_line_error(exc, "must be an integer in")
