"""The federated class-incremental split: tasks x clients views of one :class:`DatasetBundle`.

Per-task partition seeding. Task t's training samples are partitioned with the generator
``np.random.default_rng([seed, t])``: every task's partition is deterministic given
``(seed, t)`` and independent of every other task (and of how many tasks were built before).
The STSA code instead calls ``setup_seed(seed)`` right before partitioning each task, so with
equal class counts (CIFAR-100) every task receives the *same* client-by-class proportion
pattern; docs/methods/stsa.md §1.2 / §6 #12 calls both defensible and recommends independent
partitions, which is what we do.

``partition`` picks the per-task partitioner: "dirichlet" (default, the project protocol),
"class-subsets" (LGA: a random ``class_fraction`` of the task's classes per client, all their
samples) or "task-pool" (STAMP's limitless task pool, :mod:`.task_pool`: every client its own
sequence of ``classes_per_task``-class blocks of a private class permutation, all samples of those
classes; ``tasks[t]`` is then every class, since one head covers all classes from the start, and
:meth:`FederatedSplit.client_task_classes` / :meth:`FederatedSplit.client_task_test` give each
client's own tasks for per-client evaluation); see :mod:`.paper_partitions`.
``initial_clients > 0`` makes clients join over time (LGA): a client not yet joined at task t
holds an empty partition and the task is split over the joined clients only.
``old_only_fraction > 0`` (LGA's Z_o) additionally leaves a seeded share of the clients joined
*before* task t without task-t data (:func:`.paper_partitions.old_only_clients`, generator
``default_rng([seed, t, 1])``, separate from the partition's, so the other clients' split draw
is the one of a federation without those clients); no sample is dropped.
"""

from __future__ import annotations

import numbers
import os
from functools import lru_cache
from typing import Any

import numpy as np

from .bundle import DatasetBundle
from .errors import DatasetError
from .labelled import LabelledDataset
from .paper_partitions import PROTOCOL_ARGS, class_subset_partition
from .partition import dirichlet_partition
from .plan import FederationLayout, TaskPlan, plan_tasks
from .registry import load_dataset
from .task_pool import samples_of_classes

PARTITIONS = ("dirichlet", "class-subsets", "task-pool")


class FederatedSplit(FederationLayout):
    """Which training samples each client holds at each task, and the matching test sets.

    A :class:`~fcl_flower.data.plan.FederationLayout` (tasks, joining and memory-only clients,
    task-pool sequences: all drawn from the seed) plus the data. Built once per (bundle,
    num_tasks, first_task_classes, num_clients, beta, seed). Tasks and clients are 0-based.
    Client index arrays are positions in ``bundle.train`` (equivalently ``bundle.train_eval``),
    sorted per task for the pooled views and shuffled per client.
    """

    bundle: DatasetBundle
    beta: float
    _task_idx: list[np.ndarray]
    _client_idx: list[list[np.ndarray]]

    def __init__(
        self,
        bundle: DatasetBundle,
        num_tasks: int,
        first_task_classes: int = 0,
        num_clients: int = 5,
        beta: float = 0.5,
        seed: int = 0,
        partition: str = "dirichlet",
        class_fraction: float = 0.6,
        initial_clients: int = 0,
        joining_per_task: int = 0,
        old_only_fraction: float = 0.0,
        classes_per_task: int = 0,
    ) -> None:
        if partition not in PARTITIONS:
            raise DatasetError(f"unknown partition {partition!r}; choose one of: {', '.join(PARTITIONS)}")
        if not isinstance(num_clients, numbers.Integral) or isinstance(num_clients, bool) or num_clients < 1:
            raise DatasetError(f"num_clients must be an integer >= 1, got {num_clients!r}")
        if not isinstance(beta, numbers.Real) or not np.isfinite(beta) or beta <= 0:
            raise DatasetError(f"beta (Dirichlet concentration) must be a finite number > 0, got {beta!r}")
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
            raise DatasetError(f"seed must be an integer >= 0, got {seed!r}")
        task_pool = partition == "task-pool"
        if task_pool and first_task_classes:
            raise DatasetError("partition task-pool has no large first task; set first-task-classes to 0")
        plan = TaskPlan(
            bundle.name,
            tuple(str(int(c)) for c in bundle.class_order),
            plan_tasks(bundle.num_classes, num_tasks, first_task_classes, task_pool),
            bundle.image_shape,
        )
        super().__init__(
            plan,
            int(num_clients),
            int(seed),
            partition,
            initial_clients=initial_clients,
            joining_per_task=joining_per_task,
            old_only_fraction=old_only_fraction,
            classes_per_task=classes_per_task,
        )
        self.bundle = bundle
        self.beta = float(beta)
        train_y = bundle.train.targets
        self._task_idx, self._client_idx = [], []
        if self.client_classes is not None:  # STAMP's task pool: all samples of each client's classes
            for t in range(len(self.tasks)):
                clients = [samples_of_classes(train_y, self.client_classes[u, t]) for u in range(self.num_clients)]
                pooled = np.unique(np.concatenate(clients))
                for ix in (*clients, pooled):
                    ix.setflags(write=False)
                self._task_idx.append(pooled)
                self._client_idx.append(clients)
            return
        for t, r in enumerate(self.tasks):
            idx = np.flatnonzero((train_y >= r.start) & (train_y < r.stop)).astype(np.int64)
            active = np.setdiff1d(np.flatnonzero(self.join_task <= t), self.old_only[t])
            if len(idx) < len(active):
                raise DatasetError(
                    f"task {t} has {len(idx)} training samples but num_clients={len(active)}; "
                    "use fewer clients or fewer tasks"
                )
            rng = np.random.default_rng([self.seed, t])
            try:
                if partition == "class-subsets":
                    parts = class_subset_partition(train_y[idx], len(active), class_fraction, rng)
                else:
                    parts = dirichlet_partition(train_y[idx], len(active), self.beta, rng)
            except DatasetError as exc:
                raise DatasetError(f"task {t}: {exc}") from None
            idx.setflags(write=False)
            self._task_idx.append(idx)
            clients = [idx[:0].copy() for _ in range(self.num_clients)]
            for k, p in zip(active, parts):
                clients[k] = idx[p]
            for c in clients:
                c.setflags(write=False)
            self._client_idx.append(clients)

    def _source(self, eval_transform: bool) -> LabelledDataset:
        return self.bundle.train_eval if eval_transform else self.bundle.train

    # -- training views --------------------------------------------------------------------
    def active_clients(self, task: int) -> np.ndarray:
        """Clients that have joined by task ``task`` (Z_o included: they train on their memory)."""
        return np.flatnonzero(self.join_task <= self._task(task)).astype(np.int64)

    def client_indices(self, task: int, client: int) -> np.ndarray:
        """Positions in ``bundle.train`` of client ``client``'s samples at task ``task``."""
        return self._client_idx[self._task(task)][self._client(client)]

    def client_train(self, task: int, client: int, *, eval_transform: bool = False) -> LabelledDataset:
        """The client's local training data of the task (eval transforms for statistics)."""
        return self._source(eval_transform).subset(self.client_indices(task, client))

    def task_train(self, task: int, *, eval_transform: bool = False) -> LabelledDataset:
        """All clients' training data of the task, pooled (for the joint / centralised bound)."""
        return self._source(eval_transform).subset(self._task_idx[self._task(task)])

    def label_counts(self, task: int) -> np.ndarray:
        """``(num_clients, c_t)`` int64 per-client class counts; column j is label ``tasks[task][j]``."""
        r = self.tasks[self._task(task)]
        y = self.bundle.train.targets
        return np.stack([np.bincount(y[ix] - r.start, minlength=len(r)) for ix in self._client_idx[task]]).astype(
            np.int64
        )

    # -- test views ------------------------------------------------------------------------
    def seen_test(self, upto_task: int) -> LabelledDataset:
        """Test samples of every class of tasks ``0..upto_task`` (evaluation without task id)."""
        n = self.num_seen_classes(upto_task)
        return self.bundle.test.subset(np.flatnonzero(self.bundle.test.targets < n))

    def task_test(self, task: int) -> LabelledDataset:
        """Test samples of the classes of task ``task`` only (for the accuracy matrix A_{t,tau})."""
        r = self.tasks[self._task(task)]
        y = self.bundle.test.targets
        return self.bundle.test.subset(np.flatnonzero((y >= r.start) & (y < r.stop)))

    def client_test(self, upto_task: int, client: int) -> LabelledDataset:
        """Client ``client``'s held-out samples of every class of tasks ``0..upto_task`` (federated
        evaluation in simulation). The clients' test sets partition the test set: each class's test
        samples are dealt to the clients in proportion to their training samples of the class
        (evenly when no client holds it), so counts summed over clients equal the central ones.
        Under the task pool every client holds the whole test set of its own classes (clients
        share classes there; each is scored on its own, as centrally)."""
        upto_task, client = self._task(upto_task), self._client(client)
        y = self.bundle.test.targets
        if self.client_classes is not None:
            own = self.client_classes[client, : upto_task + 1].reshape(-1)
            return self.bundle.test.subset(samples_of_classes(y, own))
        owner = self._test_owners()
        keep = np.flatnonzero((y < self.num_seen_classes(upto_task)) & (owner == client))
        return self.bundle.test.subset(keep)

    def _test_owners(self) -> np.ndarray:
        """For every test sample, the client it is dealt to (cached; seeded per class)."""
        cached = getattr(self, "_owners", None)
        if cached is not None:
            return cached
        y = self.bundle.test.targets
        owners = np.full(len(y), -1, dtype=np.int64)
        train_y = self.bundle.train.targets
        for t, r in enumerate(self.tasks):
            for c in r:
                held = np.array([np.count_nonzero(train_y[ix] == c) for ix in self._client_idx[t]], dtype=np.float64)
                weights = held if held.sum() > 0 else np.ones(self.num_clients)
                idx = np.flatnonzero(y == c)
                idx = idx[np.random.default_rng([self.seed, c, 2]).permutation(len(idx))]
                counts = apportion(len(idx), weights)
                owners[idx] = np.repeat(np.arange(self.num_clients), counts)
        owners.setflags(write=False)
        self._owners: np.ndarray = owners
        return owners

    def client_task_test(self, task: int, client: int) -> LabelledDataset:
        """Test samples of the classes of client ``client``'s task ``task`` (task pool scoring)."""
        classes = self.client_task_classes(task, client)
        return self.bundle.test.subset(samples_of_classes(self.bundle.test.targets, classes))

    def __repr__(self) -> str:
        return (
            f"FederatedSplit({self.bundle.name}, tasks={self.num_tasks}, clients={self.num_clients}, "
            f"beta={self.beta}, seed={self.seed})"
        )


def apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Split ``total`` items in proportion to ``weights`` (largest remainders, ties to the lower
    index): non-negative integers summing to ``total``."""
    share = total * weights / weights.sum()
    counts = np.floor(share).astype(np.int64)
    order = np.lexsort((np.arange(len(weights)), -(share - counts)))
    counts[order[: total - int(counts.sum())]] += 1
    return counts


@lru_cache(maxsize=16)
def get_federated_split(
    dataset: str,
    root: str | os.PathLike[str] | None,
    download: bool,
    seed: int,
    num_tasks: int,
    first_task_classes: int,
    num_clients: int,
    beta: float,
    image_size: int | None = None,
    **protocol: Any,
) -> FederatedSplit:
    """Load the dataset (seeded class order) and build its split once per process (cached).

    ``protocol``: any of :data:`PROTOCOL_ARGS` (FederatedSplit's defaults otherwise).
    """
    unknown = sorted(set(protocol) - set(PROTOCOL_ARGS))
    if unknown:
        raise DatasetError(f"unknown split argument(s): {', '.join(unknown)}")
    bundle = load_dataset(dataset, root=root, download=download, seed=seed, image_size=image_size)
    return FederatedSplit(bundle, num_tasks, first_task_classes, num_clients, beta, seed, **protocol)
