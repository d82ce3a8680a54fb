"""Class-incremental data layer: datasets, class order, task split and federated partition.

Typical use (one call per client process, cached)::

    split = get_federated_split("digits", None, False, 0, num_tasks=5, first_task_classes=0,
                                num_clients=5, beta=0.5)
    local = split.client_train(task=0, client=3, eval_transform=True)

The names below are imported on first use (PEP 562), so that a module of this package that needs
no torch (the array cache, the errors, the partitions) can be imported without the datasets:
a ClientApp message without a model never imports torch (issue 32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fcl_flower.lazy import lazy_attributes

if TYPE_CHECKING:
    from .bundle import DatasetBundle, class_order, remap_labels
    from .errors import DatasetError
    from .federated import FederatedSplit, get_federated_split
    from .labelled import LabelledDataset
    from .partition import dirichlet_partition
    from .plan import FederationLayout, TaskPlan
    from .registry import DATASETS, default_root, load_dataset
    from .synthetic import SyntheticSpec, make_synthetic
    from .tasks import task_class_ranges

_WHERE = {
    "DATASETS": "registry",
    "DatasetBundle": "bundle",
    "DatasetError": "errors",
    "FederatedSplit": "federated",
    "FederationLayout": "plan",
    "LabelledDataset": "labelled",
    "SyntheticSpec": "synthetic",
    "TaskPlan": "plan",
    "class_order": "bundle",
    "default_root": "registry",
    "dirichlet_partition": "partition",
    "get_federated_split": "federated",
    "load_dataset": "registry",
    "make_synthetic": "synthetic",
    "remap_labels": "bundle",
    "task_class_ranges": "tasks",
}

__all__ = [
    "DATASETS",
    "DatasetBundle",
    "DatasetError",
    "FederatedSplit",
    "FederationLayout",
    "LabelledDataset",
    "SyntheticSpec",
    "TaskPlan",
    "class_order",
    "default_root",
    "dirichlet_partition",
    "get_federated_split",
    "load_dataset",
    "make_synthetic",
    "remap_labels",
    "task_class_ranges",
]


__getattr__ = lazy_attributes(__name__, _WHERE, globals())
