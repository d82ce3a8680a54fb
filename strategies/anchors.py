"""LANDER's label-text embeddings (LTE): the class names, and a pretrained text encoder.

LANDER anchors every class at the embedding of its label text by a pretrained language model
(docs/method_notes_target_lander.md §3.1). The LTE its code ships are 512-d float16 vectors of
norm ≈ 10, the output size of CLIP ViT-B's text tower, so the default encoder is
``openai/clip-vit-base-patch32``, loaded through Hugging Face ``transformers`` when that package
is installed and the weights are cached or downloadable. Offline, or without ``transformers``
(this project does not depend on it), :func:`label_text_embeddings` falls back -- with one log
line -- to deterministic embeddings hashed from the class names
(:func:`fcl_flower.fcl.generative.name_anchors`); ``text-encoder = "name-hash"`` asks for them.

Only the server computes the LTE; clients receive them in every LANDER message
(``TrainIns.anchors``), so no client needs the language model.
"""

from __future__ import annotations

import importlib
import pickle
from logging import INFO, WARNING
from pathlib import Path

import torch
from flwr.common.logger import log

from fcl_flower.config import RunConfig
from fcl_flower.data.plan import PUBLIC_SHAPES, TaskPlan
from fcl_flower.fcl.generative import name_anchors

NAME_HASH = "name-hash"
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
LTE_NORM = 10.0  # norm of the fallback anchors: that of the LTE the LANDER code ships


def class_names(cfg: RunConfig, plan: TaskPlan) -> list[str]:
    """The label text of every class, in class-order position (label) order.

    Public datasets (the plan names each class by its original id): digits, the number words;
    CIFAR-100, the fine label names of the dataset's ``meta`` file (underscores as spaces);
    Tiny-ImageNet, the first WordNet lemma of each wnid (``words.txt``); anything else, or a file
    that cannot be read, ``"class <original id>"``. ``dataset = custom``: the plan's class names.
    """
    if plan.dataset not in PUBLIC_SHAPES:
        return [name.replace("_", " ") for name in plan.class_names]
    originals = [int(c) for c in plan.class_names]
    table: dict[int, str] = {}
    try:
        if plan.dataset == "digits":
            table = dict(enumerate(DIGIT_NAMES))
        elif plan.dataset == "cifar100":
            with open(Path(cfg.data_dir) / "cifar-100-python" / "meta", "rb") as handle:
                meta = pickle.load(handle, encoding="latin1")
            table = dict(enumerate(meta["fine_label_names"]))
        elif plan.dataset == "tiny-imagenet":
            folder = Path(cfg.data_dir) / "tiny-imagenet-200"
            wnids = sorted({w.strip() for w in (folder / "wnids.txt").read_text().splitlines() if w.strip()})
            words = dict(
                line.split("\t", 1) for line in (folder / "words.txt").read_text().splitlines() if "\t" in line
            )
            table = {i: words.get(w, w).split(",")[0].strip() for i, w in enumerate(wnids)}
    except (OSError, KeyError, ValueError, pickle.UnpicklingError) as err:
        log(WARNING, "LANDER: no class names for %s (%s); using 'class <id>'", plan.dataset, type(err).__name__)
        table = {}
    return [str(table.get(c, f"class {c}")).replace("_", " ") for c in originals]


def label_text_embeddings(names: list[str], encoder: str, dim: int) -> tuple[torch.Tensor, str]:
    """(LTE of ``names`` as a float32 (len(names), dim) tensor, where they came from).

    ``encoder`` is a Hugging Face model id; the real encoder is tried first and any failure
    (no ``transformers``, no network and no cache, a wrong output size) falls back to
    :func:`name_anchors` with one log line.
    """
    if encoder and encoder != NAME_HASH:
        try:
            embeddings = _encode(names, encoder)
            if embeddings.shape != (len(names), dim):
                raise ValueError(f"it gives {tuple(embeddings.shape[1:])}-d embeddings, the anchor head has {dim}")
            log(INFO, "LANDER: label-text embeddings from %s", encoder)
            return embeddings, encoder
        except Exception as err:  # ImportError, OSError (offline), ValueError: all mean "not available"
            reason = str(err).splitlines()[0][:160] if str(err) else type(err).__name__
            log(
                WARNING,
                "LANDER: text encoder '%s' unavailable (%s); using deterministic name-hash label embeddings",
                encoder,
                reason,
            )
    return name_anchors(names, dim, LTE_NORM), NAME_HASH


@torch.no_grad()
def _encode(names: list[str], encoder: str) -> torch.Tensor:
    """The pretrained text encoder's embedding of each label text.

    CLIP models: the projected text embedding (``text_embeds``); other models (BERT, sentence
    encoders): the attention-masked mean of the last hidden states.
    """
    transformers = importlib.import_module("transformers")  # optional: not a project dependency
    tokenizer = transformers.AutoTokenizer.from_pretrained(encoder)
    config = transformers.AutoConfig.from_pretrained(encoder)
    tokens = tokenizer(names, padding=True, truncation=True, return_tensors="pt")
    if "clip" in str(getattr(config, "model_type", "")):
        model = transformers.CLIPTextModelWithProjection.from_pretrained(encoder).eval()
        return model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).text_embeds.float()
    model = transformers.AutoModel.from_pretrained(encoder).eval()
    hidden = model(**tokens).last_hidden_state
    mask = tokens["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    return ((hidden * mask).sum(dim=1) / mask.sum(dim=1)).float()
