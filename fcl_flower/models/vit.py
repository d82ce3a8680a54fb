"""ViT-B/16 (timm) with AdaptFormer adapters, as used by STSA's ViT first stage.

Adapter (AdaptFormer "parallel", as in APER / STSA [CODE]):

    x1  = x + drop_path1(ls1(attn(norm1(x))))                       # unchanged timm attention branch
    out = x1 + drop_path2(ls2(mlp(norm2(x1)))) + s * up(dropout(relu(down(x1))))

The adapter reads ``x1``, the residual stream *after* attention and *before* ``norm2`` (no
LayerNorm), which is why replacing ``block.mlp`` alone cannot express it: the wrapped MLP only
ever sees ``norm2(x1)``.

How the wrapping is done (and why it is not a fragile monkeypatch): :class:`AdapterBlock` is a
small ``nn.Module`` that *takes over* the sub-modules of one timm ``Block`` (``norm1``, ``attn``,
``ls1``, ``drop_path1``, ``norm2``, ``mlp``, ``ls2``, ``drop_path2``) under their original
attribute names, adds ``adapter``, and re-states timm's two-line pre-norm forward with the adapter
term. :func:`add_adapters` swaps each entry of ``vit.blocks`` for such a wrapper. Consequences:

* parameter names of the pretrained part are unchanged (``blocks.3.attn.qkv.weight``...), so
  timm checkpoints and :func:`~fcl_flower.models.full_state` keys line up;
* we refuse anything that is not exactly timm's ``Block`` (other block types have another
  forward) with a :class:`ModelError`, instead of silently computing something else.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .base import Backbone, ModelError

__all__ = [
    "VIT_B16_TIMM_NAME",
    "Adapter",
    "AdapterBlock",
    "ViTAdapterBackbone",
    "add_adapters",
    "create_timm_vit",
]

#: timm name of the ImageNet-21k AugReg ViT-B/16 weights (the non-deprecated spelling of
#: ``vit_base_patch16_224_in21k`` that STSA [CODE] loads).
VIT_B16_TIMM_NAME = "vit_base_patch16_224.augreg_in21k"

ADAPTER_BOTTLENECK = 64
ADAPTER_SCALE = 0.1
ADAPTER_DROPOUT = 0.1


class Adapter(nn.Module):
    """Bottleneck adapter ``s * up(dropout(relu(down(x))))`` with LoRA-style init.

    ``down`` gets kaiming-uniform(a=sqrt(5)) weights and zero bias, ``up`` zero weights and zero
    bias, so the adapter outputs exactly 0 at initialisation and the adapted ViT starts as the
    pretrained ViT.
    """

    def __init__(
        self,
        dim: int,
        bottleneck: int = ADAPTER_BOTTLENECK,
        scale: float = ADAPTER_SCALE,
        dropout: float = ADAPTER_DROPOUT,
    ) -> None:
        super().__init__()
        if dim < 1 or bottleneck < 1:
            raise ModelError(f"adapter needs dim >= 1 and bottleneck >= 1, got {dim} and {bottleneck}")
        self.scale = float(scale)
        self.down = nn.Linear(dim, bottleneck)
        self.act = nn.ReLU()
        self.dropout = nn.Dropout(dropout)
        self.up = nn.Linear(bottleneck, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.down.weight, a=math.sqrt(5))
            nn.init.zeros_(self.down.bias)
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.scale * self.up(self.dropout(self.act(self.down(x))))


def _timm_block_type() -> type[nn.Module]:
    from timm.models.vision_transformer import Block

    return Block


def _module(parent: nn.Module, name: str) -> nn.Module:
    child = getattr(parent, name)
    if not isinstance(child, nn.Module):
        raise ModelError(f"{type(parent).__name__}.{name} is not a module")
    return child


class AdapterBlock(nn.Module):
    """A timm pre-norm ViT ``Block`` plus a parallel adapter on the MLP branch (see module doc)."""

    def __init__(self, block: nn.Module, adapter: Adapter) -> None:
        super().__init__()
        block_type = _timm_block_type()
        if type(block) is not block_type:
            raise ModelError(f"adapters can only wrap timm.models.vision_transformer.Block, got {type(block).__name__}")
        # Same attribute names as timm's Block, so state_dict keys are unchanged.
        self.norm1 = _module(block, "norm1")
        self.attn = _module(block, "attn")
        self.ls1 = _module(block, "ls1")
        self.drop_path1 = _module(block, "drop_path1")
        self.norm2 = _module(block, "norm2")
        self.mlp = _module(block, "mlp")
        self.ls2 = _module(block, "ls2")
        self.drop_path2 = _module(block, "drop_path2")
        self.adapter = adapter

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        attn = self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal)
        x = x + self.drop_path1(self.ls1(attn))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))) + self.adapter(x)


def add_adapters(
    vit: nn.Module,
    *,
    bottleneck: int = ADAPTER_BOTTLENECK,
    scale: float = ADAPTER_SCALE,
    dropout: float = ADAPTER_DROPOUT,
) -> nn.Module:
    """Wrap every block of a timm ``VisionTransformer`` in an :class:`AdapterBlock` (in place).

    Adapters are created on the device / dtype of the block they join. Returns ``vit``.
    """
    blocks = getattr(vit, "blocks", None)
    if not isinstance(blocks, nn.Sequential) or len(blocks) == 0:
        raise ModelError("add_adapters expects a timm VisionTransformer with a non-empty .blocks")
    dim = int(getattr(vit, "embed_dim"))  # noqa: B009 (timm's attribute, untyped on nn.Module)
    for i, block in enumerate(blocks):
        if isinstance(block, AdapterBlock):
            raise ModelError(f"block {i} already has an adapter")
        ref = next(block.parameters())
        adapter = Adapter(dim, bottleneck, scale, dropout).to(device=ref.device, dtype=ref.dtype)
        blocks[i] = AdapterBlock(block, adapter)
    return vit


def create_timm_vit(model_name: str, *, pretrained: bool, **kwargs: Any) -> nn.Module:
    """``timm.create_model`` that turns a failed weight download into a one-line ModelError."""
    import timm

    if not pretrained:
        return timm.create_model(model_name, pretrained=False, **kwargs)
    try:
        return timm.create_model(model_name, pretrained=True, **kwargs)
    except Exception as exc:  # network, hub cache or checkpoint errors all mean "no weights"
        raise ModelError(
            f"could not load pretrained weights for {model_name!r} "
            f"({type(exc).__name__}); no network? pre-populate the HF cache (HF_HOME) "
            "or use pretrained=false"
        ) from exc


class ViTAdapterBackbone(Backbone):
    """timm ViT with adapters in all blocks; features = CLS token after the final LayerNorm.

    Every pretrained (or randomly initialised) ViT weight is frozen at construction; only the
    adapter parameters require grad. The frozen part has no dropout / drop-path by default, so
    ``train()`` only switches on the adapters' dropout.
    """

    def __init__(
        self,
        vit: nn.Module,
        *,
        bottleneck: int = ADAPTER_BOTTLENECK,
        scale: float = ADAPTER_SCALE,
        dropout: float = ADAPTER_DROPOUT,
    ) -> None:
        if getattr(vit, "global_pool", None) != "token" or getattr(vit, "num_classes", None) != 0:
            raise ModelError("ViT backbone needs timm global_pool='token' and num_classes=0")
        super().__init__(feature_dim=int(getattr(vit, "num_features")))  # noqa: B009 (as above)
        for p in vit.parameters():
            p.requires_grad_(False)
        self.vit = add_adapters(vit, bottleneck=bottleneck, scale=scale, dropout=dropout)

    def forward(self, x: Tensor) -> Tensor:
        # num_classes=0 -> identity head; global_pool='token' -> norm(x)[:, 0] (no fc_norm).
        return self.vit(x)
