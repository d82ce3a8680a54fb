"""Class-incremental data layer: datasets, class order, task split and federated partition.

Typical use (one call per client process, cached)::

    split = get_federated_split("digits", None, False, 0, num_tasks=5, first_task_classes=0,
                                num_clients=5, beta=0.5)
    local = split.client_train(task=0, client=3, eval_transform=True)
"""

from .bundle import DatasetBundle, class_order, remap_labels
from .errors import DatasetError
from .federated import FederatedSplit, get_federated_split
from .labelled import LabelledDataset
from .partition import dirichlet_partition
from .plan import FederationLayout, TaskPlan
from .registry import DATASETS, default_root, load_dataset
from .synthetic import SyntheticSpec, make_synthetic
from .tasks import task_class_ranges

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
