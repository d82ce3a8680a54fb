"""Tests for the backbone registry (fcl_flower.models).

Everything is built with random weights and offline; the ViT-B/16 is built once (at 32x32 input,
i.e. 4 patches, so its forward is cheap) and the adapter wiring is also checked on a 2-block tiny
timm ViT.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from torch import nn

from fcl_flower.models import (
    BACKBONES,
    Adapter,
    AdapterBlock,
    CosineHead,
    IncrementalClassifier,
    ModelError,
    ResNet18,
    add_adapters,
    build_backbone,
    build_classifier,
    freeze,
    full_state,
    load_trainable_state,
    pick_device,
    trainable_state,
)
from fcl_flower.models import vit as vit_module

VIT_DIM, VIT_BLOCKS, BOTTLENECK = 768, 12, 64
ADAPTER_PARAMS = VIT_BLOCKS * (VIT_DIM * BOTTLENECK + BOTTLENECK + BOTTLENECK * VIT_DIM + VIT_DIM)


def _states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _tiny_vit(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        depth=2,
        img_size=32,
        patch_size=8,
        num_classes=0,
        global_pool="token",
    )


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def vit_b16() -> nn.Module:
    return build_backbone("vit-b16-adapter", image_size=32, seed=0)


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("name", "in_channels", "size", "dim"),
    [
        ("small-cnn", 1, 8, 128),  # digits
        ("small-cnn", 3, 32, 128),
        ("resnet18-cifar", 3, 32, 512),
        ("resnet18", 3, 64, 512),  # Tiny-ImageNet
    ],
)
def test_backbone_feature_shapes(name: str, in_channels: int, size: int, dim: int) -> None:
    model = build_backbone(name, in_channels=in_channels, image_size=size, seed=0).eval()
    assert model.feature_dim == dim
    with torch.no_grad():
        out = model(torch.randn(3, in_channels, size, size))
    assert out.shape == (3, dim)
    assert torch.isfinite(out).all()


def test_vit_b16_shape_and_trainable_count(vit_b16: nn.Module) -> None:
    assert vit_b16.feature_dim == VIT_DIM
    with torch.no_grad():
        out = vit_b16.eval()(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, VIT_DIM)
    trainable = {n: p for n, p in vit_b16.named_parameters() if p.requires_grad}
    assert sum(p.numel() for p in trainable.values()) == ADAPTER_PARAMS
    assert all(".adapter." in n for n in trainable)
    assert sum(isinstance(b, AdapterBlock) for b in vit_b16.vit.blocks) == VIT_BLOCKS


def test_vit_feature_is_cls_token_after_final_norm(vit_b16: nn.Module) -> None:
    x = torch.randn(2, 3, 32, 32)
    vit = vit_b16.eval().vit
    with torch.no_grad():
        tokens = vit.forward_features(x)  # already passed through the final LayerNorm
        assert torch.allclose(vit_b16(x), tokens[:, 0], atol=1e-6)
        assert torch.allclose(tokens, vit.norm(vit.blocks(vit.norm_pre(vit._pos_embed(vit.patch_embed(x))))))


def test_resnet_stems() -> None:
    x = torch.randn(1, 3, 32, 32)
    cifar, imagenet = ResNet18(stem="cifar"), ResNet18(stem="imagenet")
    assert cifar.stem(x).shape[-2:] == (32, 32)  # 3x3 stride 1, no max-pool
    assert imagenet.stem(x).shape[-2:] == (8, 8)  # 7x7 stride 2 + max-pool
    assert not any(isinstance(m, nn.MaxPool2d) for m in cifar.modules())
    assert [len(layer) for layer in (cifar.layer1, cifar.layer2, cifar.layer3, cifar.layer4)] == [2, 2, 2, 2]


@pytest.mark.parametrize("head", ["cosine", "linear"])
def test_classifier_outputs_all_classes(head: str) -> None:
    clf = build_classifier("small-cnn", 7, in_channels=1, image_size=8, head=head, seed=1).eval()
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert clf(x).shape == (4, 7)
        assert torch.equal(clf.features(x), clf.backbone(x))
        assert torch.allclose(clf(x), clf.head(clf.features(x)))


# ----------------------------------------------------------------------------- seeding


@pytest.mark.parametrize("name", ["small-cnn", "resnet18-cifar"])
def test_same_seed_same_weights_different_seed_different(name: str) -> None:
    a = full_state(build_backbone(name, seed=3))
    b = full_state(build_backbone(name, seed=3))
    c = full_state(build_backbone(name, seed=4))
    assert _states_equal(a, b)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].is_floating_point())


def test_seeded_classifier_covers_head_and_leaves_global_rng_alone() -> None:
    before = torch.get_rng_state()
    a = build_classifier("small-cnn", 5, in_channels=1, image_size=8, seed=11)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_classifier("small-cnn", 5, in_channels=1, image_size=8, seed=11)
    c = build_classifier("small-cnn", 5, in_channels=1, image_size=8, seed=12)
    assert _states_equal(full_state(a), full_state(b))
    assert not torch.equal(a.head.weight, c.head.weight)


def test_seed_is_reproducible_across_processes(tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    code = (
        "import torch, sys; torch.manual_seed(12345);"  # a different global RNG state
        "from fcl_flower.models import build_backbone, full_state;"
        f"torch.save(full_state(build_backbone('small-cnn', seed=7)), {str(out)!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
    other = torch.load(out)
    assert _states_equal(other, full_state(build_backbone("small-cnn", seed=7)))


def test_vit_seed_reproducible_on_adapters(vit_b16: nn.Module) -> None:
    # Adapters are the only trainable part; their init must also follow the seed.
    tiny_a, tiny_b = add_adapters(_tiny_vit(0)), add_adapters(_tiny_vit(0))
    assert _states_equal(full_state(tiny_a), full_state(tiny_b))
    down = vit_b16.vit.blocks[0].adapter.down.weight
    assert not torch.equal(down, vit_b16.vit.blocks[1].adapter.down.weight)


# ----------------------------------------------------------------------------- adapters


def test_adapter_init() -> None:
    ad = Adapter(96, 16)
    assert torch.count_nonzero(ad.down.bias) == 0
    assert torch.count_nonzero(ad.up.weight) == 0 and torch.count_nonzero(ad.up.bias) == 0
    bound = 1.0 / math.sqrt(96)  # kaiming_uniform(a=sqrt(5)) bound = 1/sqrt(fan_in)
    assert ad.down.weight.abs().max() <= bound
    assert ad.down.weight.abs().max() > 0.8 * bound  # genuinely uniform, not tiny
    assert ad.scale == pytest.approx(0.1) and ad.dropout.p == pytest.approx(0.1)


@pytest.mark.parametrize("train_mode", [False, True])
def test_adapters_start_as_identity(train_mode: bool) -> None:
    plain = _tiny_vit(5)
    adapted = add_adapters(copy.deepcopy(plain))
    plain.train(train_mode)
    adapted.train(train_mode)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(adapted(x), plain(x))
    # parameter names of the pretrained part are unchanged by the wrapping
    assert set(plain.state_dict()) == {k for k in adapted.state_dict() if ".adapter." not in k}


def test_adapter_is_parallel_to_mlp_on_prenorm_residual() -> None:
    vit = add_adapters(_tiny_vit(2)).eval()
    blk = vit.blocks[0]
    with torch.no_grad():
        nn.init.normal_(blk.adapter.up.weight)
        nn.init.normal_(blk.adapter.up.bias)
        x = torch.randn(2, 17, vit.embed_dim)
        x1 = x + blk.attn(blk.norm1(x))
        ad = blk.adapter
        expected = x1 + blk.mlp(blk.norm2(x1)) + 0.1 * ad.up(torch.relu(ad.down(x1)))
        wrong = x1 + blk.mlp(blk.norm2(x1)) + 0.1 * ad.up(torch.relu(ad.down(blk.norm2(x1))))
        got = blk(x)
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, wrong, atol=1e-3)


def test_adapter_wrapper_rejects_other_blocks() -> None:
    with pytest.raises(ModelError, match="Block"):
        AdapterBlock(nn.Linear(4, 4), Adapter(4, 2))
    vit = add_adapters(_tiny_vit(0))
    with pytest.raises(ModelError, match="already"):
        add_adapters(vit)


def test_vit_only_adapters_and_head_train(vit_b16: nn.Module) -> None:
    clf = IncrementalClassifier(vit_b16, 10, head="cosine").train()
    trainable = [n for n, p in clf.named_parameters() if p.requires_grad]
    assert all(".adapter." in n or n.startswith("head.") for n in trainable)
    assert {"head.weight", "head.sigma"} <= set(trainable)
    state = trainable_state(clf)
    assert list(state) == trainable  # no BN in a ViT: exactly the trainable parameters
    assert sum(v.numel() for v in state.values()) == ADAPTER_PARAMS + 10 * VIT_DIM + 1
    # gradients reach the adapters (up starts at zero, so its grad is the informative one) only
    clf.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(clf(torch.randn(2, 3, 32, 32)), torch.tensor([1, 3])).backward()
    assert clf.backbone.vit.blocks[5].adapter.up.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in clf.parameters() if not p.requires_grad)
    clf.zero_grad(set_to_none=True)


def test_pretrained_download_failure_is_model_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_create_model(name: str, pretrained: bool = False, **kwargs: object) -> nn.Module:
        if pretrained:
            raise OSError("Name or service not known")
        raise AssertionError("should not build without weights")

    monkeypatch.setattr(timm, "create_model", fake_create_model)
    with pytest.raises(ModelError, match="pretrained=false") as info:
        build_backbone("vit-b16-adapter", image_size=224, pretrained=True)
    assert "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert vit_module.VIT_B16_TIMM_NAME in str(info.value)


# ----------------------------------------------------------------------------- state


def _bn_buffer_keys(model: nn.Module) -> set[str]:
    return {
        f"{m_name}.{b}"
        for m_name, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d)
        for b in ("running_mean", "running_var", "num_batches_tracked")
    }


def test_trainable_state_is_params_plus_bn_buffers() -> None:
    clf = build_classifier("small-cnn", 4, in_channels=1, image_size=8, seed=0)
    state = trainable_state(clf)
    params = {n for n, p in clf.named_parameters() if p.requires_grad}
    buffers = _bn_buffer_keys(clf)
    assert len(buffers) == 9
    assert set(state) == params | buffers
    assert list(state) == list(trainable_state(build_classifier("small-cnn", 4, in_channels=1, image_size=8)))
    # copies, not views: training the model afterwards does not change the snapshot
    snapshot = state["backbone.features.0.1.running_mean"].clone()
    clf.train()(torch.randn(8, 1, 8, 8) + 3.0)
    assert torch.equal(state["backbone.features.0.1.running_mean"], snapshot)
    assert not torch.equal(clf.backbone.features[0][1].running_mean, snapshot)


def test_trainable_state_round_trip() -> None:
    src = build_classifier("resnet18-cifar", 6, seed=0).train()
    with torch.no_grad():
        src(torch.randn(4, 3, 32, 32) * 2 + 1)  # move the BN running statistics off their init
        src.head.sigma.fill_(3.5)
    dst = build_classifier("resnet18-cifar", 6, seed=1)
    load_trainable_state(dst, trainable_state(src))
    assert _states_equal(trainable_state(dst), trainable_state(src))
    assert _states_equal(full_state(dst), full_state(src))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(src.eval()(x), dst.eval()(x))


def test_load_trainable_state_is_strict() -> None:
    model = build_classifier("small-cnn", 3, in_channels=1, image_size=8, seed=0)
    state = trainable_state(model)
    missing = dict(state)
    missing.pop("head.sigma")
    with pytest.raises(ModelError, match="missing"):
        load_trainable_state(model, missing)
    with pytest.raises(ModelError, match="unexpected"):
        load_trainable_state(model, {**state, "extra.weight": torch.zeros(1)})
    bad = dict(state)
    bad["head.weight"] = torch.zeros(4, 128)
    with pytest.raises(ModelError, match="shape"):
        load_trainable_state(model, bad)
    # a failed load leaves the model untouched
    assert _states_equal(trainable_state(model), state)


def test_freeze() -> None:
    clf = build_classifier("small-cnn", 3, in_channels=1, image_size=8, seed=0).train()
    assert freeze(clf) is clf
    assert not any(p.requires_grad for p in clf.parameters())
    assert not any(m.training for m in clf.modules())
    # only the BN statistics remain in the trainable state of a frozen model
    assert set(trainable_state(clf)) == _bn_buffer_keys(clf)
    x = torch.randn(5, 1, 8, 8)
    assert torch.equal(clf(x), clf(x))  # eval: BN uses running statistics, deterministic


def test_full_state_rebuilds_model() -> None:
    src = build_backbone("small-cnn", in_channels=1, image_size=8, seed=0).train()
    with torch.no_grad():
        src(torch.randn(6, 1, 8, 8))
    state = full_state(src)
    assert list(state) == list(src.state_dict())
    dst = build_backbone("small-cnn", in_channels=1, image_size=8, seed=9)
    dst.load_state_dict(state)
    x = torch.randn(3, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(freeze(src)(x), freeze(dst)(x))


# ----------------------------------------------------------------------------- head, errors, device


def test_cosine_head_scale_invariance_and_bounds() -> None:
    torch.manual_seed(0)
    head = CosineHead(16, 5)
    assert head.sigma.item() == 1.0 and head.sigma.requires_grad
    f = torch.randn(4, 16)
    with torch.no_grad():
        logits = head(f)
        for c in (1e-3, 0.5, 7.0, 1e4):
            assert torch.allclose(head(c * f), logits, atol=1e-6)
        assert logits.abs().max() <= 1.0 + 1e-6
        direct = (f / f.norm(dim=1, keepdim=True)) @ (head.weight / head.weight.norm(dim=1, keepdim=True)).T
        assert torch.allclose(logits, direct, atol=1e-6)
        head.sigma.fill_(4.0)
        assert torch.allclose(head(f), 4.0 * logits, atol=1e-6)


def test_unknown_backbone_lists_valid_names() -> None:
    assert issubclass(ModelError, ValueError)
    with pytest.raises(ModelError) as info:
        build_backbone("resnet50")
    assert all(name in str(info.value) for name in BACKBONES)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: build_classifier("small-cnn", 3, head="mlp"), "cosine, linear"),
        (lambda: build_classifier("small-cnn", 0), "num_classes"),
        (lambda: build_backbone("resnet18-cifar", pretrained=True), "pretrained"),
        (lambda: build_backbone("vit-b16-adapter", image_size=40), "divisible by 16"),
        (lambda: build_backbone("small-cnn", in_channels=0), "in_channels"),
        (lambda: build_backbone("small-cnn", seed=1.5), "seed"),
    ],
)
def test_bad_requests_raise_model_error(call, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        call()


def test_pick_device() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert pick_device().type == expected
    assert pick_device(prefer_gpu=False).type == "cpu"
