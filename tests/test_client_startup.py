"""What a ClientApp process pays before it can answer: Flower starts one process per message on a
real SuperNode, so the import path and the data loading of one message must be lean.

* importing the ClientApp (and the client modules of a statistics or FedAvg message) does not
  import torchvision, timm, sklearn or torch._dynamo: each costs seconds per message;
* local SGD without ``torch.optim`` (fcl_flower/fcl/sgd.py) trains bit for bit like
  ``torch.optim.SGD``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fcl_flower.fcl.sgd import MomentumSGD

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torchvision", "timm", "sklearn", "scipy", "torch._dynamo", "sympy")


def _modules_after(code: str) -> set[str]:
    """Every module a fresh interpreter has imported after running ``code`` (from the repo root)."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_clientapp_import_path_leaves_heavy_packages_out() -> None:
    loaded = _modules_after(
        "import clients.app, clients.job, clients.stsa, clients.fedavg, clients.node_data, clients.evaluate"
    )
    assert "torch" in loaded  # the model needs it; the rest must wait until a message needs it
    assert not {m for m in loaded if m.split(".")[0] in HEAVY or m.startswith("torch._dynamo")}


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 5e-4), (0.0, 0.0), (0.5, 0.0), (0.0, 1e-3)])
def test_momentum_sgd_equals_torch_sgd_bit_for_bit(momentum: float, weight_decay: float) -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))

    ours, theirs = model(), model()
    frozen = next(iter(theirs[2].parameters()))  # a frozen tensor: no grad, no update, no buffer
    frozen.requires_grad_(False)
    next(iter(ours[2].parameters())).requires_grad_(False)
    opt_ours = MomentumSGD(
        [p for p in ours.parameters() if p.requires_grad], lr=0.05, momentum=momentum, weight_decay=weight_decay
    )
    opt_theirs = torch.optim.SGD(
        [p for p in theirs.parameters() if p.requires_grad], lr=0.05, momentum=momentum, weight_decay=weight_decay
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):
        x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        for net, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()):
        assert torch.equal(a, b)


def test_momentum_sgd_refuses_negative_settings() -> None:
    with pytest.raises(ValueError, match="lr, momentum, weight_decay >= 0"):
        MomentumSGD([torch.zeros(2, requires_grad=True)], lr=-0.1)
