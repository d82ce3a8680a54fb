"""LGA and STAMP through the real Flower hooks (in-process LocalGrid), against ``finetune``.

Same digits split, same seed, same schedule for the three methods; near-IID clients (beta = 10)
so that every task is actually learned and forgetting is measurable. Checks:

* both methods forget less than finetune (F_T lower), with the same seeds;
* the exemplar memory / coreset in each node's ``context.state`` never exceeds ``memory-size``
  and holds only the client's own samples of finished tasks;
* the LGA proxy reconstructed one image per (new class, client) with the right iDLG label and
  chose an old model; STAMP's spatial matching solved its dual to a tiny duality gap.
"""

from __future__ import annotations

import numpy as np
import pytest

from clients.lga import MEMORY_STATE, load_memory
from clients.stamp import CORESET_STATE
from fcl_flower.config import ConfigError, RunConfig
from fcl_flower.runtime import federated_split
from tests.conftest import run_locally

MEMORY = 80  # 40 per class in task 2 down to 10 per class in task 5 (a client holds ~100 per task)
NUM_CLIENTS = 3


def _config(strategy: str, out) -> RunConfig:
    return RunConfig(
        strategy=strategy,
        dataset="digits",
        num_tasks=5,
        num_clients=NUM_CLIENTS,
        beta=10.0,
        stage1_rounds=3,
        rounds_per_task=2,
        local_epochs=1,
        batch_size=16,
        lr=0.05,
        memory_size=MEMORY,
        proxy_iterations=10,
        seed=0,
        out=str(out),
        run_name=strategy,
    ).validated()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lga-stamp")
    return run_locally({strategy: _config(strategy, out) for strategy in ("finetune", "lga", "stamp")})


@pytest.mark.parametrize("method", ["lga", "stamp"])
def test_forgets_less_than_finetune(runs, method):
    finetune, ours = runs["finetune"][2], runs[method][2]
    assert len(ours["stages"]) == 5
    assert ours["F_T"] < finetune["F_T"], (method, ours["F_T"], finetune["F_T"])


@pytest.mark.parametrize("method, key", [("lga", MEMORY_STATE), ("stamp", CORESET_STATE)])
def test_memory_in_context_state_within_budget(runs, method, key):
    cfg, grid, _ = runs[method]
    split = federated_split(cfg)
    last = len(split.tasks) - 1
    for node, context in grid.contexts.items():
        memory = load_memory(context.state, key, MEMORY)
        assert 0 < len(memory) <= MEMORY
        # only classes of finished tasks, each within the iCaRL quota, each index a real sample
        assert set(memory.classes) <= set(range(split.tasks[last].start))
        quota = MEMORY // memory.num_classes
        for cls in memory.classes:
            idx = memory.class_indices(cls).numpy()
            assert len(idx) <= quota and len(np.unique(idx)) == len(idx)
            task = next(t for t, r in enumerate(split.tasks) if cls in r)
            own = split.client_train(task, node - 1)
            assert np.all(np.asarray(own.targets)[idx] == cls)


def test_lga_proxy_and_stamp_matching(runs):
    lga = runs["lga"][2]["stages"]
    for stage in lga:
        proxy = stage["extra"]["lga"]
        assert proxy["reconstructions"] >= 1
        assert proxy["idlg_label_correct"] == proxy["reconstructions"]
        assert stage["extra"]["old_model"] == "proxy-selected"
    # the monitor set grows by the reconstructions of every task
    assert lga[-1]["extra"]["monitor_set"] == sum(s["extra"]["lga"]["reconstructions"] for s in lga)
    for stage in runs["stamp"][2]["stages"]:
        assert stage["extra"]["sam_max_duality_gap"] < 1e-6


def test_bad_knobs_are_rejected(tmp_path):
    from fcl_flower.results import ResultsRecorder
    from strategies import build_strategy

    for strategy, change in (("lga", {"proxy_iterations": -1}), ("stamp", {"gm_c": -0.5})):
        cfg = _config(strategy, tmp_path).replace(**change)
        with pytest.raises(ConfigError):
            build_strategy(cfg, federated_split(cfg), ResultsRecorder(cfg.output_dir, strategy, cfg.to_mapping()))


def test_seeded_global_rng_makes_a_round_independent_of_the_process_history() -> None:
    """LGA's and STAMP's training loops (like local SGD) run under ``seeded_global_rng``: random
    augmentations and dropout draw the same numbers whatever the process drew before (a fresh
    SuperNode process or the simulation's long-lived one), and the caller's generator is left as
    it was."""
    import torch

    from fcl_flower.fcl.training import seeded_global_rng

    cpu = torch.device("cpu")
    draws = []
    for before in (1, 2):
        torch.manual_seed(before)
        torch.rand(5)  # some history
        expected_after = torch.random.get_rng_state()
        with seeded_global_rng(7, cpu):
            draws.append(torch.rand(16))
        assert torch.equal(torch.random.get_rng_state(), expected_after)
    assert torch.equal(draws[0], draws[1])
    torch.manual_seed(7)
    assert torch.equal(draws[0], torch.rand(16))  # the block sees exactly the seed's stream
    with seeded_global_rng(8, cpu):
        assert not torch.equal(draws[0], torch.rand(16))
