"""Bring your own data (``dataset = custom``): sites with their own image folders.

scikit-learn's digits are written out as PNG files for three sites with uneven classes, in three
layouts (plain class folders; per-task folders with a given ``test/`` split; a manifest), site 2
holding no image of the second task. Each site is read through the client's own entry point
(``clients.node_data.node_data``) and checked sample by sample against the source arrays:
labels, tasks, pixels, the held-out split. Every folder mistake a site can make gives one line
naming the file or folder, in ``fcl-check-data`` and when the client loads the folder. Runs of
whole federations of folders (a site with a bad folder left out with its reason; real
SuperNodes equal to the in-process run) are in tests/test_deployment_own_data.py.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from clients.node_data import DatasetShape, NodeConfigError, node_data
from clients.own_data import OwnNodeData
from experiments import check_data
from fcl_flower.config import RunConfig
from fcl_flower.data import DatasetError
from fcl_flower.data.digits import digits_arrays
from fcl_flower.data.own import OwnSettings, _load_own, draw_held_out, held_out_count, load_own
from fcl_flower.data.plan import custom_plan
from fcl_flower.fcl.training import local_sgd
from fcl_flower.runtime import build_model_for_shape
from tests.conftest import small_config

NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
TASKS = [list(NAMES[:5]), list(NAMES[5:])]
NUM_SITES = 3


# --------------------------------------------------------------------------- writing the sites
def _pixels(image: np.ndarray) -> np.ndarray:
    """A digits image (1, 8, 8) in [0, 1] as the uint8 grayscale a PNG stores."""
    return np.round(image[0] * 255).astype(np.uint8)


def _save(path: Path, image: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(_pixels(image)).save(path)


def _site_of(i: int, label: int) -> int | None:
    """Uneven sites: sample i goes to site i % 3; site 0 keeps only 10 'nine's, site 1 has no
    'two' or 'seven', site 2 only the first task's classes."""
    site = i % NUM_SITES
    if (site == 1 and label in (2, 7)) or (site == 2 and label >= 5):
        return None
    return site


def write_sites(root: Path) -> dict[int, dict[str, list[tuple[str, int, int]]]]:
    """Write the three sites; per site, ``{"train" | "test" | "pool": [(file name, source index,
    label)]}`` -- ``pool``: samples whose held-out split is drawn, ``test``: given held-out."""
    x_tr, y_tr, x_te, y_te = digits_arrays()
    expected: dict[int, dict[str, list[tuple[str, int, int]]]] = {
        s: {"pool": [], "train": [], "test": []} for s in range(3)
    }
    nines = 0
    rows = []
    for i, (image, label) in enumerate(zip(x_tr, y_tr.tolist())):
        site = _site_of(i, label)
        if site == 0 and label == 9:
            nines += 1
            if nines > 10:
                continue
        name, cls = f"{i:05d}.png", NAMES[label]
        if site == 0:  # class folders; held-out drawn
            _save(root / "site-0" / cls / name, image)
            expected[0]["pool"].append((name, i, label))
        elif site == 1:  # train/task-<t>/<class>/ and a given test/<class>/
            _save(root / "site-1" / "train" / f"task-{label // 5}" / cls / name, image)
            expected[1]["train"].append((name, i, label))
        elif site == 2:  # a manifest: file, class, task; held-out drawn
            _save(root / "site-2" / "images" / name, image)
            rows.append({"file": f"images/{name}", "class": cls, "task": label // 5})
            expected[2]["pool"].append((name, i, label))
    for i, (image, label) in enumerate(zip(x_te, y_te.tolist())):
        if i % NUM_SITES == 1 and label not in (2, 7):
            name = f"t{i:05d}.png"
            _save(root / "site-1" / "test" / NAMES[label] / name, image)
            expected[1]["test"].append((name, i, label))
    with open(root / "site-2" / "manifest.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["file", "class", "task"])
        writer.writeheader()
        writer.writerows(rows)
    return expected


def write_plan(path: Path) -> Path:
    path.write_text(json.dumps({"classes": list(NAMES), "tasks": TASKS, "image-shape": [1, 8, 8]}))
    return path


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, Path]:
    root = tmp_path_factory.mktemp("sites")
    return root, write_sites(root), write_plan(root / "plan.json")


def own_config(out: Path, plan: Path, **changes) -> RunConfig:
    return small_config(
        out, dataset="custom", task_plan=str(plan), evaluation="federated", num_tasks=2, num_clients=NUM_SITES
    ).replace(**changes)


def site_config(root: Path, site: int, **extra) -> dict:
    return {"data-dir": str(root / f"site-{site}"), "partition-id": site, **extra}


def _source(name: str) -> np.ndarray:
    x_tr, _, x_te, _ = digits_arrays()
    index = int(Path(name).stem.lstrip("t"))
    return x_te[index] if Path(name).stem.startswith("t") else x_tr[index]


def _items(data: OwnNodeData, view) -> list[tuple[str, int]]:
    """(file name, label) of every sample of a view."""
    names = data.data.index.names
    return [(Path(names[j]).name, int(y)) for j, y in zip(view.indices, view.targets)]


# --------------------------------------------------------------------------- reading the sites
def test_sites_serve_exactly_their_images_with_global_labels(sites, tmp_path) -> None:
    root, expected, plan = sites
    cfg = own_config(tmp_path, plan)
    for site in range(NUM_SITES):
        data = node_data(site_config(root, site), cfg)
        assert isinstance(data, OwnNodeData)
        assert data.partition == site
        assert data.tasks == [range(5), range(5, 10)]
        assert data.shape == DatasetShape("custom", 10, (1, 8, 8))
        train = [data.train(t, eval_transform=True) for t in range(2)]
        test = data.test(1)
        for t, view in enumerate(train):  # every training sample is in its task
            assert set(view.targets.tolist()) <= set(range(5 * t, 5 * t + 5))
        seen = sorted(item for view in train for item in _items(data, view))
        held = sorted(_items(data, test))
        assert not set(seen) & set(held)
        if expected[site]["test"]:  # given split: exactly the train/ and test/ trees
            assert seen == sorted((n, y) for n, _, y in expected[site]["train"])
            assert held == sorted((n, y) for n, _, y in expected[site]["test"])
        else:  # drawn split: train and held-out partition the site's images
            assert sorted(seen + held) == sorted((n, y) for n, _, y in expected[site]["pool"])
        for view in [*train, test]:  # pixels: the PNG bytes, as eval tensors in [0, 1]
            if not len(view):
                continue
            images, labels = view.tensors()
            names = data.data.index.names
            want = np.stack([_pixels(_source(names[j]))[None] for j in view.indices]) / 255.0
            assert images.shape == (len(view), 1, 8, 8)
            assert torch.equal(images, torch.from_numpy(want.astype(np.float32)))
            assert torch.equal(labels, torch.from_numpy(np.array(view.targets)))
    site2 = node_data(site_config(root, 2), cfg)
    assert len(site2.train(1, eval_transform=False)) == 0  # the missing task: no samples, no error
    assert set(site2.test(1).targets.tolist()) <= set(range(5))
    site1 = node_data(site_config(root, 1), cfg)
    assert not {2, 7} & set(site1.train(0, eval_transform=True).targets.tolist())  # classes it never sees
    assert set(site1.test(0).targets.tolist()) == {0, 1, 3, 4}  # held-out of the seen tasks only


def test_drawn_held_out_split_is_seeded_per_class_and_deterministic(sites, tmp_path) -> None:
    root, expected, plan = sites
    cfg = own_config(tmp_path, plan)
    data = node_data(site_config(root, 0), cfg).data
    labels = data.labels
    for label in np.unique(labels).tolist():  # round(0.2 n) of every class
        of = labels == label
        assert int((data.held_out & of).sum()) == held_out_count(int(of.sum()), 0.2)
    assert held_out_count(1, 0.2) == 0 and held_out_count(2, 0.9) == 1 and held_out_count(10, 0.2) == 2
    # the same folder anywhere (another path, another listing order) gives the same split
    copy = tmp_path / "elsewhere"
    shutil.copytree(root / "site-0", copy)
    moved = load_own(copy, data.plan, data.settings)
    assert [Path(n).name for n in moved.index.names] == [Path(n).name for n in data.index.names]
    assert np.array_equal(moved.held_out, data.held_out)
    _load_own.cache_clear()  # a fresh process: indexed again, same split
    again = node_data(site_config(root, 0), cfg).data
    assert again is not data and np.array_equal(again.held_out, data.held_out)
    # the draw depends on the run seed and the class name, and on test-fraction
    other_seed = node_data(site_config(root, 0), cfg.replace(seed=1)).data
    assert not np.array_equal(other_seed.held_out, data.held_out)
    assert int(other_seed.held_out.sum()) == int(data.held_out.sum())
    keys = data.index.keys
    renamed = draw_held_out(labels, keys, [n + "-x" for n in NAMES], 0.2, cfg.seed)
    assert not np.array_equal(renamed, data.held_out)
    none = node_data(site_config(root, 0, **{"test-fraction": 0.0}), cfg)
    assert len(none.test(1)) == 0 and len(none.train(0, eval_transform=True)) + len(
        none.train(1, eval_transform=True)
    ) == len(expected[0]["pool"])


def test_manifest_json_with_split_column_equals_the_csv(sites, tmp_path) -> None:
    root, _, plan = sites
    cfg = own_config(tmp_path, plan)
    csv_site = node_data(site_config(root, 2), cfg)
    site = tmp_path / "site-json"
    shutil.copytree(root / "site-2" / "images", site / "images")
    held = csv_site.data.held_out
    samples = []
    for j, name in enumerate(csv_site.data.index.names):
        label = int(csv_site.data.labels[j])
        sample = {"file": f"images/{Path(name).name}", "class": NAMES[label], "split": "test" if held[j] else "train"}
        samples.append(sample)
    (site / "manifest.json").write_text(json.dumps({"samples": samples}))
    json_site = node_data({"data-dir": str(site), "partition-id": 2}, cfg)
    assert json_site.data.index.format == "manifest" and json_site.data.index.given_split
    for t in range(2):
        a, b = csv_site.train(t, eval_transform=True), json_site.train(t, eval_transform=True)
        assert _items(csv_site, a) == _items(json_site, b)
    assert _items(csv_site, csv_site.test(1)) == _items(json_site, json_site.test(1))


def test_per_task_folders_without_split_and_a_test_folder_next_to_classes(sites, tmp_path) -> None:
    root, expected, plan = sites
    cfg = own_config(tmp_path, plan)
    # task folders at the top (no train/): held-out drawn
    site = tmp_path / "tasks-only"
    shutil.copytree(root / "site-1" / "train", site)
    data = node_data({"data-dir": str(site), "partition-id": 1}, cfg)
    assert not data.data.index.given_split
    total = sum(len(data.train(t, eval_transform=True)) for t in range(2)) + len(data.test(1))
    assert total == len(expected[1]["train"])
    # class folders next to test/: the held-out samples are given
    flat = tmp_path / "flat"
    for task_dir in (root / "site-1" / "train").iterdir():
        shutil.copytree(task_dir, flat, dirs_exist_ok=True)
    shutil.copytree(root / "site-1" / "test", flat / "test")
    data = node_data({"data-dir": str(flat), "partition-id": 1}, cfg)
    assert data.data.index.given_split
    assert sorted(_items(data, data.test(1))) == sorted((n, y) for n, _, y in expected[1]["test"])


def test_images_are_converted_to_the_plans_channels_and_size(tmp_path) -> None:
    site = tmp_path / "site"
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (20, 30), dtype=np.uint8)
    colour = rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)
    (site / "cat").mkdir(parents=True)
    (site / "dog").mkdir()
    Image.fromarray(grey).save(site / "cat" / "a.png")
    Image.fromarray(colour).save(site / "dog" / "b.jpg", quality=95)
    Image.fromarray(grey.astype(np.uint16) * 257).save(site / "dog" / "c.png")  # 16-bit grayscale
    rgb = custom_plan(class_names="cat,dog", plan_file="", num_tasks=1, first_task_classes=0, image_size=16)
    data = load_own(site, rgb, OwnSettings(test_fraction=0.0, augment="none"))
    images, labels = data.train(0).with_transform(None).tensors()
    assert images.shape == (3, 3, 16, 16) and labels.tolist() == [0, 1, 1]
    want = np.asarray(Image.fromarray(grey).convert("RGB").resize((16, 16), Image.Resampling.BILINEAR))
    assert torch.equal(images[0], torch.from_numpy(want).permute(2, 0, 1).float() / 255)
    assert torch.equal(images[2], images[0])  # 16 bits keep their range: the high byte
    eval_images, _ = data.train(0, eval_transform=True).tensors()  # colour: ImageNet normalisation
    assert torch.allclose(eval_images[0, 0], (images[0, 0] - 0.485) / 0.229, atol=1e-6)
    grey_plan = custom_plan(class_names="cat,dog", plan_file="", num_tasks=1, first_task_classes=0, image_size=8)
    grey_plan = type(grey_plan)(grey_plan.dataset, grey_plan.class_names, grey_plan.tasks, (1, 8, 8))
    images, _ = load_own(site, grey_plan, OwnSettings(test_fraction=0.0)).train(0, eval_transform=True).tensors()
    assert images.shape == (3, 1, 8, 8) and float(images.min()) >= 0.0 and float(images.max()) <= 1.0


def test_training_views_augment_colour_images_like_the_public_datasets(tmp_path) -> None:
    site = tmp_path / "site"
    (site / "cat").mkdir(parents=True)
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(site / "cat" / "a.png")
    plan = custom_plan(class_names="cat", plan_file="", num_tasks=1, first_task_classes=0, image_size=32)
    data = load_own(site, plan, OwnSettings(test_fraction=0.0))
    names = [type(t).__name__ for t in data.train_transform.transforms]
    assert names == ["RandomCrop", "RandomHorizontalFlip", "ToTensor", "Normalize"]
    assert [type(t).__name__ for t in data.eval_transform.transforms] == ["ToTensor", "Normalize"]
    crop_only = load_own(site, plan, OwnSettings(test_fraction=0.0, augment="crop"))
    assert [type(t).__name__ for t in crop_only.train_transform.transforms][:2] == ["RandomCrop", "ToTensor"]


def test_augmented_training_is_the_same_whatever_the_process_did_before(tmp_path) -> None:
    """Random crops and flips draw from torch's global generator; local SGD seeds it from the
    round seed (in a fork), so a SuperNode's fresh ClientApp process and the simulation's long-lived
    one train the same model, and the caller's generator is left as it was."""
    site = tmp_path / "site"
    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (site / name).mkdir(parents=True)
        for i in range(6):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(site / name / f"{i}.png")
    cfg = small_config(
        tmp_path, dataset="custom", class_names="cat,dog", num_tasks=1, image_size=16, evaluation="federated"
    )
    plan = custom_plan(class_names="cat,dog", plan_file="", num_tasks=1, first_task_classes=0, image_size=16)
    data = load_own(site, plan, OwnSettings(test_fraction=0.0)).train(0)
    assert [type(t).__name__ for t in data.transform.transforms][:2] == ["RandomCrop", "RandomHorizontalFlip"]
    trained = []
    for before in (1, 2):
        torch.manual_seed(before)
        model = build_model_for_shape(cfg, 2, plan.image_shape)
        local_sgd(model, data, cfg, lr=0.1, num_seen=2, device=torch.device("cpu"), seed=7)
        trained.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        assert torch.equal(torch.random.get_rng_state(), _state_after(before, cfg, plan))
    assert torch.equal(trained[0], trained[1])


def _state_after(seed: int, cfg: RunConfig, plan) -> torch.Tensor:
    """The global generator after seeding it with ``seed`` and building the model (no training)."""
    torch.manual_seed(seed)
    build_model_for_shape(cfg, 2, plan.image_shape)
    return torch.random.get_rng_state()


# --------------------------------------------------------------------------- bad folders
def _bad_png(path: Path) -> None:
    path.write_bytes(b"this is not a PNG")


def _truncated_png(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:60])


def _one_site(tmp_path: Path) -> Path:
    """A small valid site: 4 images of each of zero, one (task 0) and five (task 1)."""
    x_tr, y_tr, _, _ = digits_arrays()
    site = tmp_path / "site"
    for label in (0, 1, 5):
        for i in np.flatnonzero(y_tr == label)[:4].tolist():
            _save(site / NAMES[label] / f"{i:05d}.png", x_tr[i])
    return site


def _corrupt(site: Path) -> str:
    target = sorted((site / "one").iterdir())[1]
    _bad_png(target)
    return str(target)


def _truncated(site: Path) -> str:
    target = sorted((site / "five").iterdir())[0]
    _truncated_png(target)
    return str(target)


def _unknown_class(site: Path) -> str:
    (site / "one").rename(site / "uno")
    return str(site / "uno")


def _empty_class(site: Path) -> str:
    (site / "two").mkdir()
    return str(site / "two")


def _tasks_layout(site: Path) -> None:
    for cls in ("zero", "one"):
        (site / "task-0").mkdir(exist_ok=True)
        (site / cls).rename(site / "task-0" / cls)
    (site / "task-1").mkdir()
    (site / "five").rename(site / "task-1" / "five")


def _empty_task(site: Path) -> str:
    _tasks_layout(site)
    shutil.rmtree(site / "task-1" / "five")
    return str(site / "task-1")


def _wrong_task(site: Path) -> str:
    _tasks_layout(site)
    (site / "task-0" / "zero").rename(site / "task-1" / "zero")
    return str(site / "task-1" / "zero")


def _task_beyond_plan(site: Path) -> str:
    _tasks_layout(site)
    (site / "task-1").rename(site / "task-7")
    return str(site / "task-7")


def _manifest_unknown(site: Path) -> str:
    rows = [f"{p.relative_to(site).as_posix()},{p.parent.name}" for p in sorted(site.rglob("*.png"))]
    rows[2] = rows[2].rsplit(",", 1)[0] + ",uno"
    (site / "manifest.csv").write_text("file,class\n" + "\n".join(rows) + "\n")
    return f"{site / 'manifest.csv'} line 4"


def _manifest_missing_file(site: Path) -> str:
    rows = [f"{p.relative_to(site).as_posix()},{p.parent.name}" for p in sorted(site.rglob("*.png"))]
    rows.append("zero/nowhere.png,zero")
    (site / "manifest.csv").write_text("file,class\n" + "\n".join(rows) + "\n")
    return str(site / "zero" / "nowhere.png")


def _manifest_wrong_task(site: Path) -> str:
    rows = [f"{p.relative_to(site).as_posix()},{p.parent.name}," for p in sorted(site.rglob("*.png"))]
    rows[0] += "0"  # one mistake, one line (the check reports every row that has one)
    (site / "manifest.csv").write_text("file,class,task\n" + "\n".join(rows) + "\n")
    return f"{site / 'manifest.csv'} line 2"  # five/..., the first row


BAD_FOLDERS = {
    "corrupt image": (_corrupt, "cannot read image"),
    "truncated image": (_truncated, "cannot read image"),
    "unknown class": (_unknown_class, "class 'uno' is not in the run's class list"),
    "empty class folder": (_empty_class, "empty class folder"),
    "empty task folder": (_empty_task, "empty task folder"),
    "class in another task": (_wrong_task, "class 'zero' is in task 0 of the run's plan, not task 1"),
    "task beyond the plan": (_task_beyond_plan, "task 7 is not a task of the run"),
    "manifest: unknown class": (_manifest_unknown, "class 'uno' is not in the run's class list"),
    "manifest: missing file": (_manifest_missing_file, "does not exist"),
    "manifest: wrong task": (_manifest_wrong_task, "class 'five' is in task 1 of the run's plan, not task 0"),
}


@pytest.mark.parametrize("case", list(BAD_FOLDERS))
def test_a_bad_folder_is_one_line_naming_the_file_in_the_check_and_at_load(
    case: str, sites, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, _, plan = sites
    site = _one_site(tmp_path)
    breaks, why = BAD_FOLDERS[case]
    where = breaks(site)
    cfg = own_config(tmp_path / "out", plan)
    rc = check_data.main([str(site), "--run-config", f"task-plan='{plan}'", "--node-config", "partition-id=0"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert where in err and why in err
    data = node_data({"data-dir": str(site), "partition-id": 0}, cfg)  # the node config itself is fine
    with pytest.raises(DatasetError) as info:  # the first use of the folder, whatever task the file is in
        data.train(0, eval_transform=True)
    assert "\n" not in str(info.value) and where in str(info.value) and why in str(info.value)


def test_check_command_reports_counts_per_class_per_task(sites, capsys: pytest.CaptureFixture[str]) -> None:
    root, expected, plan = sites
    rc = check_data.main([str(root / "site-1"), "--run-config", f"task-plan='{plan}' seed=0"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "imagefolder" in out and "held-out samples given by the folder" in out
    train = {NAMES[y]: 0 for y in range(10)}
    test = dict(train)
    for _, _, y in expected[1]["train"]:
        train[NAMES[y]] += 1
    for _, _, y in expected[1]["test"]:
        test[NAMES[y]] += 1
    for y, name in enumerate(NAMES):
        if name in ("two", "seven"):
            assert f" {name} " not in out
            continue
        assert f"{y // 5:>4}  {name:<5}  {train[name]:>7}  {test[name]:>8}" in out
    assert "classes of the plan this site does not hold (fine): two, seven" in out
    assert "needs its client id" in out  # no partition-id given
    rc = check_data.main(
        [str(root / "site-2"), "--run-config", f"task-plan='{plan}'", "--node-config", "partition-id=2"]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "manifest" in out and "no training images for task(s) 1" in out
    assert "needs its client id" not in out


@pytest.mark.parametrize(
    ("node_config", "why"),
    [
        ({"partition-id": 0}, "names no image folder"),
        ({"data-dir": "."}, "has no partition-id; every site needs its own client id"),
        ({"data-dir": ".", "partition-id": 3}, "partition-id 3 outside 0..2"),
        ({"data-dir": ".", "partition-id": 0, "test-fraction": 1.0}, "test-fraction must be in [0, 1)"),
        ({"data-dir": ".", "partition-id": 0, "test-fraction": "x"}, "test-fraction must be a number"),
        ({"data-dir": ".", "partition-id": 0, "data-format": "tar"}, "data-format must be one of"),
        ({"data-dir": ".", "partition-id": 0, "augment": "rotate"}, "augment must be one of"),
    ],
)
def test_node_config_errors_are_one_line(node_config: dict, why: str, sites, tmp_path) -> None:
    _, _, plan = sites
    with pytest.raises(NodeConfigError) as info:
        node_data(node_config, own_config(tmp_path, plan))
    assert why in str(info.value) and "\n" not in str(info.value)


def test_a_folder_that_is_not_there_or_is_an_export_is_refused(sites, tmp_path) -> None:
    _, _, plan = sites
    cfg = own_config(tmp_path, plan)
    missing = node_data({"data-dir": str(tmp_path / "nowhere"), "partition-id": 0}, cfg)
    with pytest.raises(DatasetError, match="is not a folder"):
        missing.train(0, eval_transform=True)
    export = tmp_path / "export"
    export.mkdir()
    (export / "meta.json").write_text("{}")
    (export / "task-0.npz").write_bytes(b"")
    with pytest.raises(DatasetError, match="exported by export_partitions"):
        node_data({"data-dir": str(export), "partition-id": 0}, cfg).train(0, eval_transform=True)


# --------------------------------------------------------------------------- Hugging Face datasets
def _hf_dataset(datasets, mapping: dict, features):
    """``Dataset.from_dict`` without its fingerprint hash (datasets 5.2.0 cannot pickle the arrow
    table for it with pyarrow >= 24: PicklingError on MonthDayNano); the folder is the same."""
    import pyarrow as pa

    table = pa.Table.from_pydict(features.encode_batch(mapping), schema=features.arrow_schema)
    return datasets.Dataset(table, info=datasets.DatasetInfo(features=features), fingerprint="fcl-flower-test")


def test_hugging_face_datasets_folder(sites, tmp_path) -> None:
    datasets = pytest.importorskip("datasets", reason="the optional extra hf (datasets) is not installed")
    _, expected, plan = sites
    cfg = own_config(tmp_path, plan)

    def table(items: list[tuple[str, int, int]]) -> dict:
        return {
            "image": [Image.fromarray(_pixels(_source(n))) for n, _, _ in items],
            "label": [y for _, _, y in items],
            "task": [y // 5 for _, _, y in items],
        }

    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=list(NAMES)), "task": datasets.Value("int64")}
    )
    given = datasets.DatasetDict(
        {
            "train": _hf_dataset(datasets, table(expected[1]["train"]), features),
            "test": _hf_dataset(datasets, table(expected[1]["test"]), features),
        }
    )
    given.save_to_disk(str(tmp_path / "hf-given"))
    data = node_data({"data-dir": str(tmp_path / "hf-given"), "partition-id": 1}, cfg)
    assert data.data.index.format == "hf" and data.data.index.given_split
    train = [data.train(t, eval_transform=True) for t in range(2)]
    for t, view in enumerate(train):
        assert set(view.targets.tolist()) <= set(range(5 * t, 5 * t + 5))
    want = sorted(y for _, _, y in expected[1]["train"])
    assert sorted(np.concatenate([v.targets for v in train]).tolist()) == want
    test = data.test(1)
    assert test.targets.tolist() == [y for _, _, y in expected[1]["test"]]  # row order
    images, _ = test.tensors()
    source = np.stack([_pixels(_source(n))[None] for n, _, _ in expected[1]["test"]]) / 255.0
    assert torch.equal(images, torch.from_numpy(source.astype(np.float32)))
    # one split, class names as strings: the held-out samples are drawn, as for a folder
    strings = datasets.Features({"img": datasets.Image(), "class": datasets.Value("string")})
    pool = expected[0]["pool"]
    plain = _hf_dataset(datasets, {"img": table(pool)["image"], "class": [NAMES[y] for _, _, y in pool]}, strings)
    plain.save_to_disk(str(tmp_path / "hf-plain"))
    data = node_data({"data-dir": str(tmp_path / "hf-plain"), "partition-id": 0}, cfg)
    assert not data.data.index.given_split
    labels = data.data.labels
    assert sorted(labels.tolist()) == sorted(y for _, _, y in pool)
    for label in np.unique(labels).tolist():
        of = labels == label
        assert int((data.data.held_out & of).sum()) == held_out_count(int(of.sum()), 0.2)
    # a row of an unknown class, in the check and at load: one line naming its row
    bad = _hf_dataset(datasets, {"img": table(pool[:2])["image"], "class": ["zero", "uno"]}, strings)
    bad.save_to_disk(str(tmp_path / "hf-bad"))
    why = r"hf-bad \(row 1\): class 'uno' is not in the run's class list"
    with pytest.raises(DatasetError, match=why):
        node_data({"data-dir": str(tmp_path / "hf-bad"), "partition-id": 0}, cfg).train(0, eval_transform=True)


def test_the_check_reports_every_problem_of_a_folder_in_one_run(
    sites, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three problems in one folder: one ``error:`` line each, in one run, then exit 2; a site
    still stops at the first."""
    _, _, plan = sites
    site = _one_site(tmp_path)
    wheres = [_truncated(site), _unknown_class(site), _empty_class(site)]  # in three different classes
    rc = check_data.main([str(site), "--run-config", f"task-plan='{plan}'", "--node-config", "partition-id=0"])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert rc == 2 and captured.out == ""
    assert len(lines) == 3 and all(line.startswith("error: ") for line in lines), lines
    for where, why in zip(wheres, ["cannot read image", "is not in the run's class list", "empty class folder"]):
        assert sum(where in line and why in line for line in lines) == 1, (where, lines)
    data = node_data({"data-dir": str(site), "partition-id": 0}, own_config(tmp_path / "out", plan))
    with pytest.raises(DatasetError) as info:
        data.train(0, eval_transform=True)
    assert "\n" not in str(info.value)


def test_the_check_reports_every_bad_row_of_a_manifest(sites, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, plan = sites
    site = _one_site(tmp_path)
    rows = [f"{p.relative_to(site).as_posix()},{p.parent.name}" for p in sorted(site.rglob("*.png"))]
    rows[2] = rows[2].rsplit(",", 1)[0] + ",uno"
    rows.append("zero/nowhere.png,zero")
    rows.append(rows[0])
    (site / "manifest.csv").write_text("file,class\n" + "\n".join(rows) + "\n")
    rc = check_data.main([str(site), "--run-config", f"task-plan='{plan}'"])
    lines = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(lines) == 3, lines
    assert "line 4" in lines[0] and "class 'uno'" in lines[0]
    assert "nowhere.png does not exist" in lines[1] and "is listed twice" in lines[2]
