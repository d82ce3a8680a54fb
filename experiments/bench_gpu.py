"""GPU against CPU: feature-extraction throughput and the stage times of stsa runs that share a GPU.

    python -m experiments.bench_gpu                  # throughput + three stsa runs (~5 min on one GPU)
    python -m experiments.bench_gpu --skip-runs      # throughput only
    python -m experiments.bench_gpu --quick          # small counts: checks the script end to end

**Throughput** (images/s) of the two backbones docs/benchmarks.md names, on every device this machine
has (``cpu``, and ``cuda`` when a GPU is visible):

* ``app path``: what a client does for its statistics, :func:`fcl_flower.runtime.iter_features`
  over the digits test images with the run's evaluation transform (resized to the backbone's
  input size), batch ``--batch-size``: data loading, the resize, the forward pass and the copy
  back to the host in float64 are all in it;
* ``model only``: ``model.features`` on a batch already on the device (the forward pass alone),
  synchronised before the clock stops.

Backbones: the default ``small-cnn`` at the digits' 8 × 8 and ``vit-b16-adapter`` (ViT-B/16,
random initialisation: no weights can be downloaded here) at 224 × 224.

**Runs**: ``experiments/sim.py --strategy stsa`` on Flower's Ray simulation, each client given a
fraction ``--num-gpus`` of the GPU (0.2: five clients share it): the default configuration, the
same on the CPU (``--num-gpus 0 --device cpu``), and ViT-B/16 (random init, 224 × 224). The table
lists every stage's wall time from the run's results.json.

Writes experiments/results/bench_gpu.json (machine, GPU and load included). Without a GPU the
cuda rows and the GPU runs are left out and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from experiments.benchlib import OneLineErrorParser, format_table, write_json
from fcl_flower.config import RunConfig
from fcl_flower.runtime import build_model, federated_split, iter_features

REPO = Path(__file__).resolve().parent.parent

#: (backbone, image size) pairs measured; 0 is the dataset's own size.
BACKBONES: tuple[tuple[str, int], ...] = (("small-cnn", 0), ("vit-b16-adapter", 224))


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def model_only(model: Any, shape: Sequence[int], batch: int, images: int, device: torch.device) -> float:
    """Images/s of ``model.features`` on a batch already on ``device`` (one warm-up batch)."""
    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(0)).to(device)
    model.eval().to(device)
    model.features(x)
    _sync(device)
    steps = max(1, images // batch)
    start = time.perf_counter()
    for _ in range(steps):
        model.features(x)
    _sync(device)
    return steps * batch / (time.perf_counter() - start)


def app_path(model: Any, dataset: Any, cfg: RunConfig, images: int, device: torch.device) -> float:
    """Images/s of the client's feature path (loader, transform, forward, float64 copy back)."""
    for _ in iter_features(model, dataset, cfg, device):  # warm-up: one batch
        break
    seen = 0
    start = time.perf_counter()
    while seen < images:
        for features, _labels in iter_features(model, dataset, cfg, device):
            seen += int(features.shape[0])
    return seen / (time.perf_counter() - start)


def throughput(*, images: dict[str, int], batch: int) -> list[dict[str, Any]]:
    rows = []
    for backbone, size in BACKBONES:
        cfg = RunConfig(backbone=backbone, image_size=size, batch_size=batch, device="auto").validated()
        split = federated_split(cfg)
        dataset = split.seen_test(len(split.tasks) - 1)
        shape = tuple(int(d) for d in dataset[0][0].shape)
        for name in devices():
            device = torch.device(name)
            budget = images[f"{backbone}/{name}"]
            model = build_model(cfg, split)
            row = {
                "backbone": backbone,
                "input": "x".join(map(str, shape)),
                "device": name,
                "batch": batch,
                "images": budget,
                "model_only_img_s": model_only(model, shape, batch, budget, device),
                "app_path_img_s": app_path(model, dataset, cfg, budget, device),
            }
            rows.append(row)
            print(format_table([row], list(row)), flush=True)
    return rows


def run_sim(label: str, flags: list[str], out: Path, timeout: float) -> dict[str, Any]:
    """One ``sim.py`` run; its wall time and every stage's seconds and accuracy (results.json)."""
    cmd = [sys.executable, str(REPO / "experiments" / "sim.py"), "--strategy", "stsa", *flags]
    cmd += ["--out", str(out), "--run-name", label, "--overwrite"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    print(f"[{label}] {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        code, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired:
        code, tail = -1, f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - start
    result: dict[str, Any] = {"label": label, "flags": flags, "exit_code": code, "wall_seconds": wall}
    path = out / label / "results.json"
    if code != 0 or not path.exists():
        result["error"] = tail
        print(f"[{label}] failed (exit {code}):\n{tail}", flush=True)
        return result
    data = json.loads(path.read_text())
    result["stages"] = [
        {"stage": s["stage"], "seconds": s["seconds"], "accuracy": s["accuracy"], "rounds": s["rounds"]}
        for s in data["stages"]
    ]
    stages = ", ".join(f"{s['seconds']:.1f}" for s in result["stages"])
    print(f"[{label}] exit 0 in {wall:.1f} s; stage seconds: {stages}", flush=True)
    return result


RUN_LABELS = ("stsa-default-gpu", "stsa-default-cpu", "stsa-vit-b16-gpu")


def runs(
    *,
    num_gpus: float,
    vit_rounds: int,
    quick: bool,
    timeout: float,
    done: Callable[[list[dict[str, Any]]], None],
    only: Sequence[str] = RUN_LABELS,
) -> list[dict[str, Any]]:
    """The stsa runs named in ``only``; ``done`` gets the results so far after each (so a cut-off
    leaves them)."""
    small = ["--num-tasks", "2", "--stage1-rounds", "1"] if quick else []
    plans: list[tuple[str, list[str]]] = []
    if torch.cuda.is_available():
        plans.append(("stsa-default-gpu", [*small, "--num-gpus", str(num_gpus)]))
    plans.append(("stsa-default-cpu", [*small, "--num-gpus", "0", "--device", "cpu"]))
    if torch.cuda.is_available():
        vit = ["--backbone", "vit-b16-adapter", "--image-size", "224", "--stage1-rounds", str(vit_rounds)]
        plans.append(("stsa-vit-b16-gpu", [*small, *vit, "--num-gpus", str(num_gpus)]))
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_gpu-") as tmp:
        for label, flags in (plan for plan in plans if plan[0] in only):
            results.append(run_sim(label, flags, Path(tmp), timeout))
            done(results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Few images and a two-task run per config.")
    parser.add_argument("--skip-runs", action="store_true", help="Throughput only, no sim.py runs.")
    parser.add_argument("--skip-throughput", action="store_true", help="The sim.py runs only.")
    parser.add_argument("--only", nargs="+", choices=RUN_LABELS, default=RUN_LABELS, help="The runs to do.")
    parser.add_argument("--batch-size", type=int, default=64, help="Feature-extraction batch (the run's default).")
    parser.add_argument("--num-gpus", type=float, default=0.2, help="GPU share per simulated client.")
    parser.add_argument("--vit-rounds", type=int, default=10, help="FedAvg rounds of the ViT run's stage 1.")
    parser.add_argument("--run-timeout", type=float, default=900.0, help="Seconds allowed to each sim.py run.")
    parser.add_argument("--out", default=None, help="JSON path (default experiments/results/bench_gpu.json).")
    args = parser.parse_args(argv)
    if args.batch_size < 1 or not 0 < args.num_gpus <= 1 or args.vit_rounds < 0:
        print("error: --batch-size >= 1, 0 < --num-gpus <= 1 and --vit-rounds >= 0 are required", file=sys.stderr)
        return 2
    scale = 1 if args.quick else 8
    images = {
        "small-cnn/cpu": 2048 * scale,
        "small-cnn/cuda": 4096 * scale,
        "vit-b16-adapter/cpu": 64 if args.quick else 256,
        "vit-b16-adapter/cuda": 512 * scale,
    }
    try:
        return measure(args, images)
    except Exception as err:  # CUDA, a dataset, a run that cannot start: one line, not a traceback
        print(f"error: bench_gpu failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


def measure(args: argparse.Namespace, images: dict[str, int]) -> int:
    """Throughput, then the runs; the JSON is written after each part. 0, or 1 if a run failed."""
    result: dict[str, Any] = {"gpu_visible": torch.cuda.is_available(), "images": images}
    print(f"GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none visible'}", flush=True)
    if not args.skip_throughput:
        result["throughput"] = throughput(images=images, batch=args.batch_size)
    path = write_json("bench_gpu", result, args.out)
    if not args.skip_runs:

        def save(done: list[dict[str, Any]]) -> None:
            write_json("bench_gpu", {**result, "runs": done}, args.out)

        result["runs"] = runs(
            num_gpus=args.num_gpus,
            vit_rounds=args.vit_rounds,
            quick=args.quick,
            timeout=args.run_timeout,
            done=save,
            only=args.only,
        )
    print(f"wrote {path}")
    failed = [r["label"] for r in result.get("runs", []) if r["exit_code"] != 0]
    if failed:
        print(f"error: runs failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
