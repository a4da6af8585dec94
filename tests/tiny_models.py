"""Tiny models and datasets for tests: built from scratch, saved like real ones, loaded in milliseconds.

No weights are downloaded: every model is randomly initialised (seeded) and saved with
``save_pretrained`` (safetensors), and the tokenizers are built from small vocabularies that
cover the words of the test captions, so loading goes through the same code paths as a real
CLIP, BERT or T5 directory.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from diffusers import AutoencoderKL
from PIL import Image
from transformers import (
    BertConfig,
    BertModel,
    BertTokenizer,
    BitImageProcessor,
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Dinov2Config,
    Dinov2Model,
    T5Config,
    T5Model,
)

from latentforge.data.schema import RAW_COLUMNS, DatasetIndex, write_index, write_shard

# Words of typical test captions (the synthetic shapes dataset and make_raw_dataset below).
COLOURS = ("red", "yellow", "green", "cyan", "blue", "purple", "white", "black", "orange", "pink", "gray")
SHAPES = ("circle", "square", "triangle", "star", "cross", "diamond", "rectangle")
POSITIONS = ("top", "bottom", "left", "right", "center", "middle", "corner", "edge")
SIZES = ("small", "large", "big", "tiny")
OTHER = ("a", "an", "the", "in", "on", "at", "of", "with", "and", "picture", "photo", "light", "dark", "background")
WORDS = COLOURS + SHAPES + POSITIONS + SIZES + OTHER + (",", ":", ".")


def make_tiny_vae(root: str | Path, seed: int = 0, scaling_factor: float = 0.5,
                  shift_factor: float | None = 0.1) -> Path:
    """A 2-level AutoencoderKL (downsample factor 2, 4 latent channels, about 40k parameters).

    The scale factors are deliberately not Stable Diffusion's, so a test sees whether they are
    read from the config or hard-coded.
    """
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=32, scaling_factor=scaling_factor, shift_factor=shift_factor,
    )
    vae.save_pretrained(root, safe_serialization=True)
    return Path(root)


def _bert_tokenizer() -> BertTokenizer:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    return BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=32)


def make_tiny_bert(root: str | Path, seed: int = 0) -> Path:
    """A 2-layer BertModel (hidden size 16, with pooler) and its word-level tokenizer; unknown
    words become [UNK]."""
    torch.manual_seed(seed)
    tok = _bert_tokenizer()
    config = BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertModel(config).save_pretrained(root)
    tok.save_pretrained(root)
    return Path(root)


def make_tiny_t5(root: str | Path, seed: int = 0) -> Path:
    """A full (encoder-decoder) 1-layer T5Model without a tokenizer: pair it with
    ``make_tiny_bert``'s tokenizer (same vocabulary size)."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=len(_bert_tokenizer()), d_model=16, d_kv=8, d_ff=32, num_layers=1,
                      num_decoder_layers=1, num_heads=2, decoder_start_token_id=0)
    T5Model(config).save_pretrained(root)
    return Path(root)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character map of GPT-2/CLIP byte-level BPE (Radford et al. 2019)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _clip_vocab_and_merges(words: Sequence[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary in which each word of ``words`` is a single token.

    Every byte is a token (alone and word-final, ``x</w>``), so any text tokenizes; each word
    gets the merges that join its characters left to right.
    """
    base = list(_bytes_to_unicode().values())
    tokens = base + [c + "</w>" for c in base]
    merges: list[tuple[str, str]] = []
    for word in words:
        chars = list(word)
        chars[-1] += "</w>"
        joined = chars[0]
        for c in chars[1:]:
            if (joined, c) not in merges:
                merges.append((joined, c))
                tokens.append(joined + c)
            joined += c
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab: dict[str, int] = {}
    for t in tokens:
        vocab.setdefault(t, len(vocab))
    return vocab, merges


def make_tiny_clip(root: str | Path, seed: int = 0) -> Path:
    """A 2-layer CLIPTextModel (hidden size 16, 77 positions) and its byte-level BPE tokenizer.

    The tokenizer gets its vocabulary as a dict and its merges as pairs: transformers 5 ignores
    ``vocab_file=``/``merges_file=`` and would give a 2-token tokenizer.
    """
    torch.manual_seed(seed)
    vocab, merges = _clip_vocab_and_merges([w for w in WORDS if w.isalpha()])
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    eos = vocab["<|endoftext|>"]
    config = CLIPTextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=77, projection_dim=8,
                            bos_token_id=vocab["<|startoftext|>"], eos_token_id=eos, pad_token_id=eos)
    CLIPTextModel(config).save_pretrained(root)
    tok.save_pretrained(root)
    return Path(root)


def make_tiny_clip_model(root: str | Path, seed: int = 0, image_size: int = 32) -> Path:
    """A full CLIPModel (1-layer text and vision towers, 8-d projections, 8 px patches) with its
    processor: the byte-level BPE tokenizer of :func:`make_tiny_clip` and a CLIPImageProcessor at
    ``image_size``, as ``CLIPModel.from_pretrained`` + ``CLIPProcessor.from_pretrained`` expect."""
    torch.manual_seed(seed)
    vocab, merges = _clip_vocab_and_merges([w for w in WORDS if w.isalpha()])
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    eos = vocab["<|endoftext|>"]
    text = dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=77, bos_token_id=vocab["<|startoftext|>"], eos_token_id=eos, pad_token_id=eos)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=image_size, patch_size=8)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)).save_pretrained(root)
    images = CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(root)
    return Path(root)


def make_tiny_dinov2(root: str | Path, seed: int = 0, image_size: int = 32) -> Path:
    """A 1-layer Dinov2Model (hidden size 16, 8 px patches) with the BitImageProcessor that DINOv2
    directories carry (resize, center crop, ImageNet normalisation) at ``image_size``."""
    torch.manual_seed(seed)
    config = Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2,
                          image_size=image_size, patch_size=8)
    Dinov2Model(config).save_pretrained(root)
    BitImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(root)
    return Path(root)


def make_tiny_inception_weights(path: str | Path, seed: int = 0) -> Path:
    """The FID Inception-v3 (torch-fidelity's TF port, the real architecture) with random weights,
    saved as a plain state dict (``torch.save``), the format of pt_inception-2015-12-05-6726825d.pth.

    Convolutions get He-normal weights, so activations neither vanish nor explode through the
    ~20 layers (the default init shrinks the 2048-d features to about 1e-8)."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    class RandomInit(FeatureExtractorInceptionV3):
        def load_state_dict(self, state_dict, strict=True, assign=False):
            return None  # keep the random initialisation

    torch.manual_seed(seed)
    empty = io.BytesIO()
    torch.save({}, empty)
    empty.seek(0)
    net = RandomInit("inception-v3-compat", ["2048"], feature_extractor_weights_path=empty)
    for m in net.modules():
        if isinstance(m, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    torch.save(net.state_dict(), path)
    return Path(path)


def _png(rng: np.random.Generator, resolution: int) -> bytes:
    """A random background colour with a rectangle of another colour."""
    pixels = np.empty((resolution, resolution, 3), dtype=np.uint8)
    pixels[:] = rng.integers(0, 256, 3)
    x0, y0 = rng.integers(0, resolution // 2, 2)
    x1, y1 = rng.integers(resolution // 2 + 1, resolution + 1, 2)
    pixels[y0:y1, x0:x1] = rng.integers(0, 256, 3)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def raw_row(i: int, image: bytes, resolution: int, caption: str) -> dict:
    """One raw sample with every column of RAW_COLUMNS."""
    return {
        "key": f"test/{i:06d}", "image": image, "image_format": "png", "caption": caption,
        "width": resolution, "height": resolution, "orig_width": resolution, "orig_height": resolution,
        "source": f"memory://test/{i}", "license": "", "sha256": hashlib.sha256(image).hexdigest(), "meta": {},
    }


def make_raw_dataset(root: str | Path, n: int, resolution: int, num_shards: int = 3, seed: int = 0,
                     bad_images: Sequence[int] = (), captions: Sequence[str] = ()) -> Path:
    """A raw dataset as ingest writes it: ``n`` PNGs with captions in ``num_shards`` shards.

    The samples at the indices in ``bad_images`` get damaged image bytes (a truncated PNG).
    ``captions``: used in turn instead of random ones.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        image = _png(rng, resolution)
        if i in bad_images:
            image = image[: len(image) // 2]
        colour, shape, size, pos = (str(rng.choice(v)) for v in (COLOURS, SHAPES, SIZES, POSITIONS))
        caption = captions[i % len(captions)] if captions else f"a {size} {colour} {shape} in the {pos}"
        rows.append(raw_row(i, image, resolution, caption))
    root = Path(root)
    bounds = np.linspace(0, n, num_shards + 1).astype(int)
    shards = [write_shard(root / f"shard-{s:06d}.parquet", rows[bounds[s]:bounds[s + 1]], RAW_COLUMNS)
              for s in range(num_shards)]
    write_index(root, DatasetIndex(kind="raw", columns=dict(RAW_COLUMNS), shards=shards,
                                   meta={"resolution": resolution}))
    return root
