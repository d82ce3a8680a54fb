"""The features cache (fcl_flower/feature_cache.py, clients/features.py; issue 32): the same
results with and without it, a second run reuses every feature, a changed backbone or changed
data misses, a damaged file is refused and recomputed, a folder open to others is refused."""

from __future__ import annotations

import io
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import clients.app
import clients.features
from fcl_flower.data import LabelledDataset
from fcl_flower.feature_cache import (
    CacheUse,
    FeatureCache,
    FeatureCacheError,
    cached_batches,
    check_folder,
    feature_key,
    load_entry,
    save_entry,
)
from fcl_flower.local_grid import LocalGrid
from fcl_flower.runtime import build_model, federated_split, iter_features, server_split
from tests.conftest import build, server_identity, small_config
from tests.test_warm_worker import assert_same_content, worker_threads

#: stage-1 training (one FedAvg round changes the backbone), then STSA statistics and federated evaluation
SETTINGS: dict[str, Any] = dict(
    rf_dim=100, num_tasks=2, num_clients=2, evaluation="federated", stage1_rounds=1, local_epochs=1
)


def run(cfg, node_config: dict[str, Any], cache: FeatureCache | None, monkeypatch: pytest.MonkeyPatch | None):
    """One in-process run whose nodes use ``cache`` as their process's memory cache (a fresh
    cache: a fresh process; None: the node config turns caching off)."""
    if monkeypatch is not None:
        monkeypatch.setattr(clients.features, "PROCESS_CACHE", cache)
    server_identity()
    strategy = build(cfg)
    strategy.stage_weights = []
    end_stage = strategy.end_stage

    def recording_end_stage(task: int):  # a copy of W after each stage
        extra = end_stage(task)
        strategy.stage_weights.append(strategy.weights.clone())
        return extra

    strategy.end_stage = recording_end_stage
    configs = [{"partition-id": k, "num-partitions": cfg.num_clients, **node_config} for k in range(cfg.num_clients)]
    grid = LocalGrid(clients.app.app, cfg.num_clients, first_node_id=1, node_configs=configs)
    strategy.start(grid)
    assert not any(r.has_error() for r in grid.replies)
    strategy.grid = grid
    return strategy


def outcome(strategy) -> list[tuple]:
    return [
        (s.accuracy, s.per_task_accuracy, s.extra.get("federated_evaluation", {}).get("accuracy"))
        for s in strategy.recorder.stages
    ]


def cache_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("features of ")]


@pytest.fixture(scope="module")
def uncached(tmp_path_factory: pytest.TempPathFactory):
    """The run without any features cache (node config feature-cache-mib=0)."""
    return run(small_config(tmp_path_factory.mktemp("uncached"), **SETTINGS), {"feature-cache-mib": 0}, None, None)


def test_the_same_results_with_and_without_the_cache_and_a_second_run_reuses_every_feature(
    uncached, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Stage-1 training (one FedAvg round changes the backbone), then STSA statistics and
    federated evaluation: without a cache, with a cold one, and in a 'new process' (a fresh
    memory cache) over the same folder: W and every accuracy are the same; the third run
    computes no feature and says so task by task."""
    caplog.set_level(logging.INFO)
    folder = tmp_path / "features"
    cfg, plain = SETTINGS, uncached
    cold = FeatureCache()
    first = run(small_config(tmp_path / "b", **cfg), {"feature-cache": str(folder)}, cold, monkeypatch)
    # per client: stats of task 0 and 1, evaluation after stage 1 and 2; the stats of a task and the
    # evaluation's held-out data are different data, so nothing repeats within one run
    assert (cold.hits, cold.misses) == (0, 8)
    assert len(cache_lines(caplog)) == 8 and all("computed and cached" in line for line in cache_lines(caplog))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(folder.iterdir())
    assert len(files) == 8 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    run_cfg = small_config(tmp_path / "b", **cfg)
    split = federated_split(run_cfg)
    data = split.client_train(0, 0, eval_transform=True)
    seeded = feature_key(build_model(run_cfg, split).backbone, data, torch.device("cpu"), run_cfg.batch_size)
    assert seeded is not None and folder / f"{seeded}.npz" not in files  # the trained backbone's features
    caplog.clear()
    fresh = FeatureCache()
    second = run(small_config(tmp_path / "c", **cfg), {"feature-cache": str(folder)}, fresh, monkeypatch)
    assert (fresh.hits, fresh.misses) == (8, 0)
    lines = cache_lines(caplog)
    assert len(lines) == 8 and all("reused from cache" in line for line in lines)
    assert any(line.startswith("features of task 1 (client 0): reused from cache ") for line in lines)
    for other in (first, second):
        assert len(other.stage_weights) == len(plain.stage_weights) == 2
        for w, v in zip(plain.stage_weights, other.stage_weights):
            assert w.dtype == v.dtype and torch.equal(w, v)
        assert outcome(other) == outcome(plain)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path (a Unix socket's path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="fclf-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_warm_worker_answers_a_stats_message_again_from_its_cache_with_the_same_reply(
    uncached, short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The node's warm worker keeps the features between messages: the same statistics message,
    three times, is computed once and reused twice, and every reply is the reply without a cache."""
    from flwr.app import Context, RecordDict

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_dir))
    grid = uncached.grid
    message, plain = next(
        (m, r)
        for m, r in zip(grid.sent, grid.replies)
        if m.metadata.message_type == "query.stats" and m.metadata.dst_node_id == 1
    )
    warm = {"partition-id": 0, "num-partitions": 2, "warm-worker": True}
    cache = FeatureCache()
    monkeypatch.setattr(clients.features, "PROCESS_CACHE", cache)
    caplog.set_level(logging.INFO)
    with worker_threads([warm], run_config={}) as handled:
        context = Context(run_id=1, node_id=1, node_config=warm, state=RecordDict(), run_config={})
        replies = [clients.app.app(message, context) for _ in range(3)]
    assert handled == ["worker-0"] * 3
    assert (cache.hits, cache.misses) == (2, 1)
    lines = cache_lines(caplog)
    assert [line.split(": ")[1].rsplit(" ", 1)[0] for line in lines] == ["computed and cached"] + [
        "reused from cache"
    ] * 2
    for reply in replies:
        assert not reply.has_error()
        assert_same_content(plain.content, reply.content)


@pytest.fixture
def model_and_data(tmp_path: Path):
    cfg = small_config(tmp_path, rf_dim=100, num_tasks=2, num_clients=2, batch_size=64)
    split = server_split(cfg)
    return cfg, build_model(cfg, split), split.client_train(0, 0, eval_transform=True)


def test_a_changed_backbone_or_changed_data_misses(model_and_data) -> None:
    cfg, model, data = model_and_data
    cpu = torch.device("cpu")
    key = feature_key(model.backbone, data, cpu, cfg.batch_size)
    assert key is not None and key == feature_key(model.backbone, data, cpu, cfg.batch_size)
    assert key != feature_key(model.backbone, data.subset(np.arange(len(data) - 1)), cpu, cfg.batch_size)
    assert key != feature_key(model.backbone, data, cpu, cfg.batch_size + 1)
    other = LabelledDataset(data.tensors()[0].numpy(), np.array(data.targets), data.transform)
    assert feature_key(model.backbone, other, cpu, cfg.batch_size) == key  # the same samples, stored anew
    changed = data.tensors()[0].numpy()
    changed[3, 0, 0, 0] = np.nextafter(changed[3, 0, 0, 0], np.float32(2))  # one sample, one ulp
    assert feature_key(model.backbone, LabelledDataset(changed, np.array(data.targets)), cpu, 7) != key
    relabelled = np.array(data.targets)
    relabelled[0] += 1
    assert feature_key(model.backbone, LabelledDataset(data.tensors()[0].numpy(), relabelled), cpu, 7) != key
    assert data.with_transform(lambda x: x).fingerprint() is None  # a transform without a faithful repr
    with torch.no_grad():  # stage-1 training moved one weight by one ulp
        weight = next(model.backbone.parameters())
        weight.view(-1)[0] = torch.nextafter(weight.view(-1)[0], torch.tensor(1.0))
    assert feature_key(model.backbone, data, cpu, cfg.batch_size) != key


def test_a_hit_yields_the_same_batches_bit_for_bit(model_and_data, tmp_path: Path) -> None:
    cfg, model, data = model_and_data
    folder = check_folder(tmp_path / "c")
    plain = list(iter_features(model, data, cfg, torch.device("cpu")))
    use = CacheUse(FeatureCache(), folder, "task 0")
    for _ in range(2):  # computed, then from memory
        batches = list(iter_features(model, data, cfg, torch.device("cpu"), use))
        assert len(batches) == len(plain) > 1
        for (z, y), (z0, y0) in zip(batches, plain):
            assert torch.equal(z, z0) and torch.equal(y, y0) and z.dtype == torch.float64
    from_disk = CacheUse(FeatureCache(), folder, "task 0")
    batches = list(iter_features(model, data, cfg, torch.device("cpu"), from_disk))
    assert from_disk.cache.hits == 1 and all(torch.equal(a[0], b[0]) for a, b in zip(batches, plain))


def _tamper_features(path: Path) -> None:
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: np.array(npz[name]) for name in npz.files}
    arrays["features"][0, 0] += 1.0  # the digest left as it was
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("damage", ["tampered", "truncated", "other arrays", "another key's file"])
def test_a_damaged_cache_file_is_refused_removed_and_recomputed(
    damage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = check_folder(tmp_path / "c")
    features, labels = torch.randn(5, 3, dtype=torch.float64), torch.arange(5)
    save_entry(folder, "k" * 64, features, labels)
    path = folder / f"{'k' * 64}.npz"
    loaded = load_entry(folder, "k" * 64)
    assert loaded is not None and torch.equal(loaded[0], features) and torch.equal(loaded[1], labels)
    if damage == "tampered":
        _tamper_features(path)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-40])
    elif damage == "other arrays":
        buffer = io.BytesIO()
        np.savez(buffer, features=features.numpy(), labels=labels.numpy())
        path.write_bytes(buffer.getvalue())
    else:  # a whole, valid entry of another key, renamed
        save_entry(folder, "j" * 64, features + 1, labels)
        os.replace(folder / f"{'j' * 64}.npz", path)
    caplog.set_level(logging.INFO)
    cache = FeatureCache()
    recomputed = list(cached_batches(CacheUse(cache, folder, "task 0"), "k" * 64, 2, iter([(features, labels)])))
    assert (cache.hits, cache.misses) == (0, 1)
    assert torch.equal(recomputed[0][0], features)
    messages = [r.getMessage() for r in caplog.records]
    assert any("is damaged" in m and "recomputed" in m for m in messages)
    assert any(m.startswith("features of task 0: computed and cached kkkkkkkkkkkk") for m in messages)
    again = load_entry(folder, "k" * 64)  # written anew, whole
    assert again is not None and torch.equal(again[0], features)


def test_a_folder_open_to_others_is_refused_in_one_line_and_the_node_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    made = check_folder(tmp_path / "new" / "cache")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    os.chmod(open_folder, 0o755)
    with pytest.raises(FeatureCacheError, match="open to group or others"):
        check_folder(open_folder)
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(FeatureCacheError, match="not a folder"):
        check_folder(link)

    class Job:  # what cache_for reads of a job
        partition = 0

        class context:
            node_config: ClassVar[dict[str, Any]] = {"feature-cache": str(open_folder)}

    caplog.set_level(logging.INFO)
    for _ in range(2):
        use = clients.features.cache_for(Job(), "task 0")  # type: ignore[arg-type]
        assert use is not None and use.folder is None  # memory only
    assert sum("open to group or others" in r.getMessage() for r in caplog.records) == 1
    Job.context.node_config = {"feature-cache": "relative/folder"}
    use = clients.features.cache_for(Job(), "task 0")  # type: ignore[arg-type]
    assert use is not None and use.folder is None
    assert sum("not an absolute path: refused" in r.getMessage() for r in caplog.records) == 1
    Job.context.node_config = {"feature-cache-mib": 0}  # no cache at all: features computed as before
    assert clients.features.cache_for(Job(), "task 0") is None  # type: ignore[arg-type]
    Job.context.node_config = {"feature-cache-mib": -1}
    with pytest.raises(ValueError, match="feature-cache-mib"):
        clients.features.cache_for(Job(), "task 0")  # type: ignore[arg-type]


class Pixels:
    """A site's image reader (fcl_flower/data/own.py PlanImages' interface): decoded uint8 arrays."""

    def __init__(self, arrays: np.ndarray) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays)

    def array(self, j: int) -> np.ndarray:
        return self.arrays[j]

    def read(self, j: int):
        from PIL import Image

        return Image.fromarray(self.arrays[j])


def test_a_sites_images_are_known_by_their_decoded_pixels_and_files_by_size_and_mtime(tmp_path: Path) -> None:
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, size=(4, 6, 6), dtype=np.uint8)
    labels = np.arange(4)
    key = LabelledDataset(Pixels(pixels), labels).fingerprint()
    assert key is not None and key == LabelledDataset(Pixels(pixels.copy()), labels).fingerprint()
    changed = pixels.copy()
    changed[2, 3, 3] ^= 1
    assert LabelledDataset(Pixels(changed), labels).fingerprint() != key
    paths = []
    for j in range(2):
        paths.append(str(tmp_path / f"{j}.png"))
        Image.fromarray(pixels[j]).save(paths[-1])
    files = LabelledDataset(paths, labels[:2])
    before = files.fingerprint()
    assert before is not None and before == files.fingerprint()
    Image.fromarray(changed[2]).save(paths[1])  # rewritten: another size or mtime
    os.utime(paths[1], ns=(1, 1))
    assert files.fingerprint() != before
