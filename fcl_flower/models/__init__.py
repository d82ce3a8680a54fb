"""Backbone registry of fcl-flower: small CNN, CIFAR/ImageNet ResNet-18, timm ViT-B/16 + adapters.

Everything a strategy or client needs from a model goes through this package: build by name
(optionally seeded), the trainable state that FedAvg averages, freezing after stage 1, and the
device to run on.
"""

from .base import Backbone, ModelError
from .cnn import SmallCNN
from .heads import HEADS, CosineHead, IncrementalClassifier
from .registry import BACKBONES, build_backbone, build_classifier
from .resnet import ResNet18
from .state import freeze, full_state, load_trainable_state, pick_device, trainable_state, trainable_tensors
from .vit import VIT_B16_TIMM_NAME, Adapter, AdapterBlock, ViTAdapterBackbone, add_adapters

__all__ = [
    "BACKBONES",
    "HEADS",
    "VIT_B16_TIMM_NAME",
    "Adapter",
    "AdapterBlock",
    "Backbone",
    "CosineHead",
    "IncrementalClassifier",
    "ModelError",
    "ResNet18",
    "SmallCNN",
    "ViTAdapterBackbone",
    "add_adapters",
    "build_backbone",
    "build_classifier",
    "freeze",
    "full_state",
    "load_trainable_state",
    "pick_device",
    "trainable_state",
    "trainable_tensors",
]
