"""Attacks on what the server and the sites read from each other (issue 31), driven through the
real strategy loop and client handlers (LocalGrid, digits): evaluation counts a client inflates
or wraps, files the server names on a client, image bombs and manifest rows that leave a site's
folder, and replies with unexpected records or sent twice. Each test asserts the outcome: the
bad input is refused with its one-line reason (and the run goes on without it), or no answer
tells the server anything about a client's file system.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ConfigRecord, Context, Message, MetricRecord, RecordDict

from clients.app import handle
from clients.node_data import node_data
from fcl_flower.config import RunConfig
from fcl_flower.data import DatasetError
from fcl_flower.data.own import OwnSettings, load_own
from fcl_flower.protocol import EvaluateIns, InfoIns, ProtocolError, parse_instruction
from fcl_flower.protocol.base import CONFIG, Header
from fcl_flower.runtime import task_plan
from tests.conftest import reply_partition, run_in_process, server_identity, small_config

SETTINGS = dict(num_tasks=2, num_clients=3, rf_dim=60, seed=0, evaluation="both")
VICTIM = 1


def config(tmp: Path, **changes) -> RunConfig:
    return small_config(tmp, **{**SETTINGS, **changes})


def on_evaluations(change, tasks: tuple[int, ...]):
    """Apply ``change(reply)`` to VICTIM's evaluation replies of ``tasks``."""

    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if phase == "evaluate" and task in tasks:
            for m in replies:
                if not m.has_error() and reply_partition(m) == VICTIM:
                    change(m)
        return replies

    return tamper


def drop_victim(task: int, phase: str, replies: list[Message]) -> list[Message]:
    if phase == "evaluate":
        return [m for m in replies if m.has_error() or reply_partition(m) != VICTIM]
    return replies


def counts(m: Message) -> tuple[np.ndarray, np.ndarray]:
    record = m.content.array_records["counts"]
    return record["correct"].numpy().copy(), record["total"].numpy().copy()


def put_counts(m: Message, correct: np.ndarray, total: np.ndarray, num_examples: int) -> None:
    record = m.content.array_records["counts"]
    record["correct"] = Array(np.ascontiguousarray(correct.astype(np.int64)))
    record["total"] = Array(np.ascontiguousarray(total.astype(np.int64)))
    m.content.metric_records["metrics"]["num-examples"] = num_examples


def federated(stage) -> dict:
    return stage.extra["federated_evaluation"]


# ------------------------------------------------------------------------------ evaluation counts
def _inflate(m: Message) -> None:
    """Claim 1000x the held-out samples of every class, all of them predicted right."""
    _, total = counts(m)
    put_counts(m, total * 1000, total * 1000, int(total.sum()) * 1000)


def _wrap(m: Message) -> None:
    """Add 2**62 samples (all right) to four classes: 2**64 more in all, which an int64 sum
    wraps back to the honest count."""
    correct, total = counts(m)
    honest = int(total.sum())
    correct[:4] += 2**62
    total[:4] += 2**62
    put_counts(m, correct, total, honest)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, list[dict]]:
    """The federated scores of the clean run and of the run without VICTIM's evaluations."""
    out = Path(tmp_path_factory.mktemp("references"))
    clean = run_in_process(config(out, run_name="clean"))
    without = run_in_process(config(out, run_name="without"), drop_victim)
    return {name: [federated(s) for s in run.recorder.stages] for name, run in (("clean", clean), ("without", without))}


def same_scores(got: dict, expected: dict) -> None:
    assert (got["accuracy"], got["per_task_accuracy"], got["samples"]) == (
        expected["accuracy"],
        expected["per_task_accuracy"],
        expected["samples"],
    )


def test_inflated_totals_after_the_first_evaluation_are_left_out(tmp_path, references) -> None:
    """A client honest at its first evaluation, then claiming 1000x its held-out samples (all
    right), is left out of the later stage's metrics with its reason: the reported numbers are
    those of the run without its evaluation."""
    attacked = run_in_process(config(tmp_path, run_name="inflated"), on_evaluations(_inflate, (1,)))
    first, later = (federated(s) for s in attacked.recorder.stages)
    assert first["left_out"] == {} and f"client-{VICTIM}" in first["clients"]
    same_scores(first, references["clean"][0])
    reason = later["left_out"][f"client-{VICTIM}"]
    assert "\n" not in reason and "first evaluation" in reason, reason
    assert f"client-{VICTIM}" not in later["clients"]
    same_scores(later, references["without"][1])


def test_counts_whose_int64_sum_wraps_are_refused(tmp_path, references) -> None:
    """Four classes with 2**62 more samples each: 2**64 in all, which an int64 sum wraps back to
    the honest sample count. Refused at every evaluation (a count beyond any held-out set)."""
    attacked = run_in_process(config(tmp_path, run_name="wrap"), on_evaluations(_wrap, (0, 1)))
    for stage, reference in zip(attacked.recorder.stages, references["without"], strict=True):
        reason = federated(stage)["left_out"][f"client-{VICTIM}"]
        assert "\n" not in reason and "exceeds" in reason, reason
        same_scores(federated(stage), reference)


def test_a_client_lying_from_its_first_evaluation_weighs_by_its_declared_share(tmp_path, references) -> None:
    """What a lying client can still do (docs/privacy.md): lie consistently from its first
    evaluation. It is then kept, and weighs exactly by the samples it declared: the reported
    accuracy is the others' counts plus its 1000x claimed (all right)."""
    attacked = run_in_process(config(tmp_path, run_name="consistent"), on_evaluations(_inflate, (0, 1)))
    for stage, clean, without in zip(attacked.recorder.stages, references["clean"], references["without"], strict=True):
        got = federated(stage)
        assert got["left_out"] == {}
        victim = clean["samples"] - without["samples"]
        assert got["samples"] == without["samples"] + 1000 * victim
        right = without["accuracy"] * without["samples"] + 1000 * victim * 100.0
        assert got["accuracy"] == pytest.approx(right / got["samples"], rel=1e-12)


# ------------------------------------------------------------------------------ server-named files
PLAN = {
    "classes": ["zero", "one", "two", "three"],
    "tasks": [["zero", "one"], ["two", "three"]],
    "image-shape": [1, 8, 8],
}


def custom_config(tmp: Path, plan: Path) -> RunConfig:
    return small_config(tmp, dataset="custom", task_plan=str(plan), evaluation="federated", num_tasks=2)


def info_message(cfg: RunConfig) -> Message:
    server_identity()
    return InfoIns(Header("run", "info", 0, 1, 1), cfg).to_message(1)


def instruction_naming(cfg: RunConfig, path: str) -> Message:
    """What a malicious server sends: a run config whose task-plan is a path on the client."""
    message = info_message(cfg)
    record = dict(message.content.config_records[CONFIG])
    record.update({"task-plan": path, "task-plan-content": ""})
    message.content.config_records[CONFIG] = ConfigRecord(record)
    return message


def test_the_server_sends_the_plan_as_content_never_as_a_path(tmp_path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    cfg = custom_config(tmp_path, plan)
    message = info_message(cfg)
    sent = message.content.config_records[CONFIG]
    assert sent["task-plan"] == "" and json.loads(str(sent["task-plan-content"])) == PLAN
    received = parse_instruction(message).config
    assert task_plan(received) == task_plan(cfg)  # the client's plan is the server's, from content


def test_a_client_never_opens_a_path_the_server_names(tmp_path) -> None:
    """A task-plan path in an instruction is refused before anything is opened, with the same
    one line whether the path is a file, a folder or nothing: no file-existence oracle."""
    real = tmp_path / "plan.json"
    real.write_text(json.dumps(PLAN))
    cfg = custom_config(tmp_path, real)
    context = Context(1, 1, {"data-dir": str(tmp_path), "partition-id": 0}, RecordDict(), {})
    reasons = set()
    for path in (str(real), str(tmp_path), str(tmp_path / "missing.json"), "/etc/shadow"):
        with pytest.raises(ProtocolError) as err:
            parse_instruction(instruction_naming(cfg, path))
        reasons.add(str(err.value))
        with pytest.raises(ProtocolError) as err:
            handle(instruction_naming(cfg, path), context)  # the ClientApp's own entry
        reasons.add(str(err.value))
    assert len(reasons) == 1, reasons
    (reason,) = reasons
    assert "task-plan" in reason and "\n" not in reason and str(tmp_path) not in reason


@pytest.mark.parametrize("content", ["{", "[1, 2]", '{"classes": "zero"}', "[" * 100_000 + "]" * 100_000])
def test_plan_content_is_validated_on_parse(tmp_path, content) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    message = info_message(custom_config(tmp_path, plan))
    record = dict(message.content.config_records[CONFIG])
    record["task-plan-content"] = content
    message.content.config_records[CONFIG] = ConfigRecord(record)
    with pytest.raises(ProtocolError, match=r"task-plan-content") as err:
        parse_instruction(message)
    assert "\n" not in str(err.value)


def test_a_clients_own_file_errors_reach_the_server_as_one_generic_line(tmp_path, caplog) -> None:
    """A site whose folder is broken fails its round; the server's error reply names no path and
    no file-system error, the detail stays in the site's own log."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    cfg = custom_config(tmp_path / "out", plan)
    secret = tmp_path / "site-folder-that-is-not-there"
    context = Context(1, 1, {"data-dir": str(secret), "partition-id": 0}, RecordDict(), {})
    server_identity()
    message = EvaluateIns(Header("run", "evaluate", 0, 1, 1), cfg, num_seen=2).to_message(1)
    with caplog.at_level(logging.WARNING), pytest.raises(Exception) as err:
        handle(message, context)
    text = f"{type(err.value).__name__}: {err.value}"
    assert str(secret) not in text and "No such file" not in text and "not a folder" not in text, text
    assert "\n" not in text and "site's log" in text
    assert str(secret) in caplog.text  # the site's operator sees the detail


def test_a_client_takes_its_dataset_folder_from_its_own_node_config(tmp_path, monkeypatch) -> None:
    """Public datasets (partition-id mode): the run config's data-root, a path the server names,
    is never where a client reads or downloads; its node config's data-root, its own
    $FCL_DATA_ROOT, or the default folder is."""
    from fcl_flower.data.registry import ROOT_ENV, default_root

    roots: list[str] = []
    monkeypatch.setattr("fcl_flower.runtime.get_federated_split", lambda **kw: roots.append(kw["root"]))
    monkeypatch.delenv(ROOT_ENV, raising=False)
    default = str(default_root().resolve())
    cfg = RunConfig(data_root=str(tmp_path / "named-by-the-server"))
    node = {"partition-id": 0, "num-partitions": cfg.num_clients}
    node_data(node, cfg)
    node_data({**node, "data-root": str(tmp_path / "mine")}, cfg)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "from-env"))
    node_data(node, cfg)
    assert roots == [default, str(tmp_path / "mine"), str(tmp_path / "from-env")]


# ------------------------------------------------------------------------------ images
def _png_header_bomb(path: Path, width: int, height: int) -> None:
    """A grayscale PNG of ``width x height`` black pixels: tiny on disk, huge decoded."""
    compressor = zlib.compressobj(9)
    row = b"\x00" * (width + 1)
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def _small_png(path: Path, value: int = 0, size: int = 8) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size), value, dtype=np.uint8)).save(path)


def _plan():
    return task_plan(
        RunConfig(dataset="custom", class_names="zero,one", num_tasks=1, image_size=8, evaluation="federated")
    )


def test_a_decompression_bomb_is_refused_in_one_line_naming_the_file(tmp_path) -> None:
    """144 megapixels in about 140 KB: refused before decoding, at the default cap."""
    site = tmp_path / "site"
    bomb = site / "zero" / "bomb.png"
    _png_header_bomb(bomb, 12_000, 12_000)
    assert bomb.stat().st_size < 200_000
    _small_png(site / "one" / "a.png")
    with pytest.raises(DatasetError) as err:
        load_own(site, _plan(), OwnSettings())
    assert str(bomb) in str(err.value) and "pixels" in str(err.value) and "\n" not in str(err.value)


def test_the_pixel_cap_is_the_sites_setting(tmp_path) -> None:
    site = tmp_path / "site"
    _small_png(site / "zero" / "a.png", size=40)
    _small_png(site / "one" / "b.png", size=8)
    with pytest.raises(DatasetError, match=r"a\.png.*1600 pixels.*1000"):
        load_own(site, _plan(), OwnSettings(max_pixels=1000))
    assert len(load_own(site, _plan(), OwnSettings(max_pixels=1600)).labels) == 2


def _manifest(site: Path, rows: list[tuple[str, str]]) -> None:
    site.mkdir(parents=True, exist_ok=True)
    (site / "manifest.csv").write_text("file,class\n" + "".join(f"{f},{c}\n" for f, c in rows))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_manifest_rows_stay_in_the_sites_folder_unless_it_opts_in(tmp_path, how) -> None:
    site, outside = tmp_path / "site", tmp_path / "elsewhere" / "x.png"
    _small_png(outside, 255)
    _small_png(site / "in" / "a.png")
    row = {"dotdot": "../elsewhere/x.png", "absolute": str(outside), "symlink": "link.png"}[how]
    if how == "symlink":
        site.mkdir(parents=True, exist_ok=True)
        (site / "link.png").symlink_to(outside)
    _manifest(site, [("in/a.png", "zero"), (row, "one")])
    with pytest.raises(DatasetError, match=r"outside the site's folder") as err:
        load_own(site, _plan(), OwnSettings())
    assert "\n" not in str(err.value) and row in str(err.value)
    opted = load_own(site, _plan(), OwnSettings(files_outside=True))
    assert sorted(opted.labels.tolist()) == [0, 1]


def test_an_image_folder_symlink_that_leaves_the_folder_is_refused(tmp_path) -> None:
    site, outside = tmp_path / "site", tmp_path / "elsewhere" / "x.png"
    _small_png(outside, 255)
    _small_png(site / "zero" / "a.png")
    (site / "one").mkdir(parents=True)
    (site / "one" / "x.png").symlink_to(outside)
    with pytest.raises(DatasetError, match=r"outside the site's folder"):
        load_own(site, _plan(), OwnSettings())
    assert len(load_own(site, _plan(), OwnSettings(files_outside=True)).labels) == 2


def test_the_opt_in_is_a_node_config_key(tmp_path) -> None:
    cfg = RunConfig(dataset="custom", class_names="zero,one", num_tasks=1, image_size=8, evaluation="federated")
    data = node_data({"data-dir": str(tmp_path), "partition-id": 0, "files-outside-data-dir": True}, cfg)
    assert data.settings.files_outside is True  # type: ignore[attr-defined]
    data = node_data({"data-dir": str(tmp_path), "partition-id": 0, "max-image-pixels": 1234}, cfg)
    assert data.settings.max_pixels == 1234 and data.settings.files_outside is False  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ replies
def on_stats(change):
    def tamper(task: int, phase: str, replies: list[Message]) -> list[Message]:
        if task == 1 and phase.endswith("stats"):
            return change(replies)
        return replies

    return tamper


def _extra_metric_record(replies: list[Message]) -> list[Message]:
    for m in replies:
        if reply_partition(m) == VICTIM:
            m.content["side-channel"] = MetricRecord({"x": 1})
    return replies


def test_an_extra_metric_record_is_refused_by_name(tmp_path) -> None:
    strategy = run_in_process(config(tmp_path, evaluation="central"), on_stats(_extra_metric_record))
    reason = strategy.recorder.stages[1].left_out[f"client-{VICTIM}"]
    assert "side-channel" in reason and "metric records" in reason and "\n" not in reason


def _duplicate(replies: list[Message]) -> list[Message]:
    return [*replies, next(m for m in replies if reply_partition(m) == VICTIM)]


def test_a_duplicate_reply_is_recorded_in_left_out(tmp_path) -> None:
    """The same node answers twice: its first reply counts (the stage is the clean one), the
    second is named in ``left_out`` with its reason."""
    clean = run_in_process(config(tmp_path, evaluation="central", run_name="clean"))
    twice = run_in_process(config(tmp_path, evaluation="central", run_name="twice"), on_stats(_duplicate))
    stage = twice.recorder.stages[1]
    duplicates = {k: v for k, v in stage.left_out.items() if "twice" in v}
    assert len(duplicates) == 1, stage.left_out
    (reason,) = duplicates.values()
    assert f"client-{VICTIM}" in reason and "\n" not in reason
    assert f"client-{VICTIM}" in stage.clients
    assert float((twice.stage_weights[1] - clean.stage_weights[1]).norm()) == 0.0


@pytest.mark.parametrize(("step", "task"), [("keys", 0), ("shares", 0), ("unmask", 1)])
def test_a_duplicate_reply_in_a_secure_step_is_recorded_in_left_out(tmp_path, step: str, task: int) -> None:
    """Under secure aggregation the key, share and unmask steps are exchanges of their own (the
    key and shares steps in the run's first secure round: later ones ride with the masked upload
    and the unmask step, shares ahead): a
    node that answers one twice is named in ``left_out`` too, and the stage is the clean one."""
    from strategies.secure import KEYS_PHASE, SHARES_PHASE, UNMASK_PHASE

    phase = {"keys": KEYS_PHASE, "shares": SHARES_PHASE, "unmask": UNMASK_PHASE}[step]

    def tamper(seen_task: int, seen: str, replies: list[Message]) -> list[Message]:
        return _duplicate(replies) if seen_task == task and seen == phase else replies

    secure = dict(evaluation="central", secure_aggregation=True, secagg_min_clients=2)
    clean = run_in_process(config(tmp_path, run_name="clean", **secure))
    twice = run_in_process(config(tmp_path, run_name="twice", **secure), tamper)
    stage = twice.recorder.stages[task]
    duplicates = {k: v for k, v in stage.left_out.items() if "twice" in v}
    assert len(duplicates) == 1, stage.left_out
    (reason,) = duplicates.values()
    assert f"client-{VICTIM}" in reason and phase in reason and "\n" not in reason
    assert float((twice.stage_weights[task] - clean.stage_weights[task]).norm()) == 0.0


def test_held_out_sizes_survive_a_resume_and_a_tampered_entry_is_refused_by_name(tmp_path) -> None:
    """The sizes fixed at each client's first evaluation are part of the checkpoint's state, so a
    resumed run keeps holding later counts to them; a saved entry for a client outside the run, a
    negative size or a non-integer is refused with one line naming the field."""
    from fcl_flower.restore import RestoreError
    from tests.conftest import build

    cfg = config(tmp_path, evaluation="federated")
    strategy = run_in_process(cfg)
    assert strategy.held_out_sizes  # every client evaluated at least once
    state = strategy.state_dict()
    resumed = build(cfg.replace(run_name="resumed"))
    resumed.load_state_dict(state)
    assert resumed.held_out_sizes == strategy.held_out_sizes
    name = sorted(state["held_out_sizes"])[0]
    for bad, words in (
        ({**state["held_out_sizes"], "client-99": [1]}, "state/held_out_sizes/client-99"),
        ({name: [-1]}, f"state/held_out_sizes/{name}/0"),
        ({name: ["3"]}, f"state/held_out_sizes/{name}/0"),
    ):
        with pytest.raises(RestoreError, match=words):
            build(cfg.replace(run_name="bad")).load_state_dict({**state, "held_out_sizes": bad})
