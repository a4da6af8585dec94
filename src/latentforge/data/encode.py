"""Encode step: raw shards (image bytes + caption) -> latent shards (VAE latents + text conditioning).

Each raw shard becomes one latent shard of the same name holding, per sample::

    key, caption, width, height       carried over from the raw shard
    latent_mean, latent_std           the VAE encoder's latent distribution, C x H/f x W/f
    text_hidden, text_mask            last hidden states (L x D) and attention mask (L) of the caption
    text_pooled                       the pooled text embedding, when the encoder has one

Storing the distribution (not one sample of it) lets the loader draw a fresh latent every epoch.
The latents are stored unscaled: the VAE's ``scaling_factor``/``shift_factor`` go into the
dataset meta, and training applies them. ``empty_prompt.safetensors`` holds the conditioning of
the empty caption, for caption dropout and classifier-free guidance.

A raw dataset ingested with aspect-ratio buckets (``ingest.image.crop: buckets``) holds images of
several sizes; its encode writes one latent dataset per bucket, ``OUT/bucket-<W>x<H>/``, and
``OUT/buckets.json`` listing them (the training loader then batches within a bucket, see
:mod:`latentforge.data.buckets`). Each bucket's pass reads the raw shards' rows of that bucket
only, but reads every raw shard: the raw data is read once per bucket.

The text encoder runs once per distinct caption (token sequence) of an encode: the text outputs
of the rows written are kept by :class:`TextCache` (``encode.text_cache_mb``) and a repeated
caption reuses them. A row's text arrays are those of a forward pass of its caption in some batch
(on the CPU byte-identical to encoding every row; on a GPU another batch can change the last
bit); a resumed encode rebuilds the cache from its finished shards and writes the same bytes as
an uninterrupted one.

The output directory is resumable per shard: a shard is done when its parquet file and its
record ``.progress/<shard>.json`` agree on the number of rows. ``.progress/meta.json`` records
which VAE, text encoder, settings and source dataset the directory was made with, and a rerun
with any of these changed is refused. ``index.json`` is written last and marks completion.

On SIGINT, SIGTERM or ``encode.interrupt.extra_signal`` (:mod:`latentforge.interrupt`) the
encode stops before its next batch: the finished shards are kept, the shard in progress (held in
memory until it is complete) is encoded again by the rerun, and the command exits with code 75.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import itertools
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal, Sequence

import numpy as np
import pyarrow.parquet as pq
import safetensors.numpy
import torch
from PIL import Image
from tqdm import tqdm

from latentforge import storage
from latentforge.config import save_config
from latentforge.data.imageproc import stable_detail
from latentforge.data.schema import (
    EMPTY_PROMPT,
    INDEX,
    DatasetIndex,
    ShardInfo,
    decode_value,
    ndarray_type,
    read_index,
    read_shard,
    write_index,
    write_shard,
)
from latentforge.errors import ConfigError, Problems, UserError
from latentforge.interrupt import InterruptConfig, StopOnSignal
from latentforge.models.autoencoder import absolute_if_local, first_line, load_vae, vae_fingerprint, vae_meta
from latentforge.models.text import (
    encode_tokens,
    load_text_encoder,
    resolve_max_length,
    text_encoder_fingerprint,
    text_encoder_meta,
    tokenize,
)

__all__ = [
    "EncodeConfig",
    "encode_dataset",
    "open_encode",
    "finish_encode",
    "EncodeJob",
    "Encoders",
    "TextCache",
    "decode_batch",
    "build_rows",
    "shard_record",
    "latent_columns",
    "decode_image",
    "RejectedImage",
    "EMPTY_PROMPT",
    "REJECTED",
    "SUMMARY",
    "CONFIG_FILE",
]

BUCKETS = "buckets.json"
REJECTED = "rejected.jsonl"
SUMMARY = "summary.json"
CONFIG_FILE = "encode_config.yaml"
PROGRESS = ".progress"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
RAW_NEEDED = ("key", "image", "caption", "width", "height")  # raw columns the encode reads


@dataclass
class EncodeConfig:
    vae: str = field(default="", metadata={
        "help": "the frozen VAE: a diffusers AutoencoderKL directory, a pipeline directory with vae/, or a hub id"})
    text_encoder: str = field(default="", metadata={
        "help": "the frozen text encoder: a transformers model directory (CLIP text, T5, BERT-like), "
                "a pipeline directory with text_encoder/ and tokenizer/, or a hub id"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer directory or hub id; None = the text encoder's own"})
    max_length: int | None = field(default=77, metadata={
        "help": "caption length in tokens (padded/truncated); None = the tokenizer's model_max_length"})
    batch_size: int = field(default=16, metadata={"help": "images per VAE/text-encoder forward pass"})
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata={
        "help": "where to run the encoders; auto = cuda if available, else cpu"})
    vae_dtype: Literal["float32", "float16", "bfloat16"] = field(default="float32", metadata={
        "help": "VAE compute dtype; the encoder is cheap next to training, and float16 VAEs can overflow"})
    text_dtype: Literal["auto", "float32", "float16", "bfloat16"] = field(default="auto", metadata={
        "help": "text encoder compute dtype; auto = float32 on cpu, bfloat16 on cuda"})
    attention_mask: Literal["on", "pipeline"] = field(default="on", metadata={
        "help": "on: the text encoder sees the captions' padding mask; pipeline: as a diffusers pipeline runs it, "
                "masked only if its config sets use_attention_mask (SD 1.x/2.x CLIP: unmasked, as they were "
                "trained); encode --from sets pipeline"})
    storage_dtype: Literal["float16", "float32"] = field(default="float16", metadata={
        "help": "dtype of the stored latents and text embeddings (float16 halves disk and read cost)"})
    text_cache_mb: int = field(default=256, metadata={
        "help": "memory (MiB) for the text encoder's outputs of captions already written: a caption that "
                "repeats one of them is not encoded again (repeated or templated captions); 0 = off. "
                "Resume stays exact: the cache is rebuilt from the finished shards"})
    interrupt: InterruptConfig = field(default_factory=InterruptConfig, metadata={
        "help": "on SIGINT / SIGTERM / a scheduler's warning signal: keep the finished shards, exit 75"})

    def require_models(self) -> None:
        """The model paths may be left empty in a recipe and given on the command line."""
        if not self.vae:
            raise ConfigError("encode.vae: required: a diffusers AutoencoderKL directory or hub id (--vae PATH)")
        if not self.text_encoder:
            raise ConfigError("encode.text_encoder: required: a text encoder directory or hub id (--text-encoder PATH)")

    def validate(self) -> None:
        problems = Problems()
        if self.max_length is not None and self.max_length < 1:
            problems.add(f"max_length: must be at least 1 (or null for the tokenizer's own), "
                         f"got {self.max_length}")
        if self.batch_size < 1:
            problems.add(f"batch_size: must be at least 1, got {self.batch_size}; images per encoder call")
        if self.text_cache_mb < 0:
            problems.add(f"text_cache_mb: must be >= 0 (0 = off), got {self.text_cache_mb}")
        problems.nested("interrupt", self.interrupt)
        problems.raise_if_any()


class _Stopped(Exception):
    """A signal asked the encode to stop (raised between batches, caught by encode_dataset)."""


class RejectedImage(Exception):
    """An image that cannot be encoded; ``reason`` is a short stable name counted in summary.json."""

    def __init__(self, reason: str, detail: str):
        super().__init__(stable_detail(detail))
        self.reason = reason


def decode_image(data: bytes | None, resolution: int | tuple[int, int]) -> np.ndarray:
    """Encoded image bytes -> RGB pixels in [-1, 1], float32 (3, H, W), as the VAE expects;
    ``resolution``: the side of a square dataset, or (width, height) of a bucket."""
    size = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    if not data:
        raise RejectedImage("missing_image", "no image bytes")
    try:
        with Image.open(io.BytesIO(data)) as im:
            rgb = im.convert("RGB")  # decodes the whole image
    except Exception as e:  # Pillow raises OSError, SyntaxError, zlib/struct errors... on damaged data
        raise RejectedImage("undecodable_image", first_line(e)) from None
    if rgb.size != size:
        raise RejectedImage("wrong_size", f"{rgb.size[0]}x{rgb.size[1]}, the dataset is {size[0]}x{size[1]}")
    return (np.asarray(rgb, dtype=np.float32) / 127.5 - 1.0).transpose(2, 0, 1)


def _resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda was requested but torch sees no CUDA device; use device=auto or cpu")
    return name


def _check_raw(raw_dir: str, raw: DatasetIndex) -> int:
    """The resolution of a raw dataset, after checking it is one."""
    if raw.kind != "raw":
        raise UserError(f"{raw_dir}: is a {raw.kind!r} dataset; encode reads the raw shards written by ingest")
    missing = [c for c in RAW_NEEDED if c not in raw.columns]
    if missing:
        raise UserError(f"{raw_dir}: raw shards lack column(s) {', '.join(missing)}")
    resolution = raw.meta.get("resolution")
    if not isinstance(resolution, int) or resolution <= 0:
        raise UserError(f"{raw_dir}: index.json meta has no integer 'resolution' (was it written by ingest?)")
    if not storage.is_s3(raw_dir):  # before any shard is encoded, not after the ones before it (S3: when read)
        gone = [s.name for s in raw.shards if not Path(raw_dir, s.name).is_file()]
        if gone:
            raise UserError(f"{raw_dir}: {len(gone)} shard(s) listed in index.json are missing ({', '.join(gone[:3])}"
                            f"{', ...' if len(gone) > 3 else ''}); rerun the ingest")
    return resolution


def _identity(meta: Any) -> Any:
    """What must match to resume: everything in the meta except where things were read from."""
    if isinstance(meta, dict):
        return {k: _identity(v) for k, v in meta.items() if not k.endswith("path")}
    return meta


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            short = [v[:12] + "..." if isinstance(v, str) and len(v) > 16 else v for v in (a, b)]
            out.append(f"{prefix}{k} ({short[0]!r} there, {short[1]!r} now)")
    return out


def _open_out_dir(out: Path, meta: dict, take_lock: Callable[[Path], None] = lambda out: None) -> None:
    """Claim ``out`` for this encode, or check that it was started with the same inputs; then
    ``take_lock(out)`` before the first write."""
    record = out / PROGRESS / "meta.json"
    if record.is_file():
        now = _identity(json.loads(json.dumps(meta)))  # compare as stored: JSON types
        diffs = _differences(_identity(json.loads(record.read_text())), now)
        if diffs:
            raise UserError(f"{out}: was encoded with a different {'; '.join(diffs)}: "
                            "use a new output directory or delete this one")
    else:
        storage.refuse_foreign_dir(out, (f"{PROGRESS}/meta.json",), "encode output")
    take_lock(out)
    storage.atomic_write_bytes(record, json.dumps(meta, indent=1).encode())
    # The dataset is incomplete until every shard is done again (index.json is the completion marker).
    (out / INDEX).unlink(missing_ok=True)


def _finished_shard(out: Path, name: str) -> dict | None:
    """The completion record of shard ``name`` if the shard file matches it, else None."""
    record, shard = out / PROGRESS / f"{name}.json", out / name
    if not (record.is_file() and shard.is_file()):
        return None
    done = json.loads(record.read_text())
    return done if pq.read_metadata(shard).num_rows == done["written"] else None


def _to_storage(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    with np.errstate(over="ignore"):  # float16 overflow becomes inf, rejected as non_finite below
        return t.detach().float().cpu().numpy().astype(dtype)


def token_keys(tokens: dict[str, torch.Tensor]) -> list[bytes]:
    """One key per row of ``tokens`` (from :func:`tokenize`): equal keys, equal encoder inputs."""
    return [a.tobytes() + b.tobytes() for a, b in zip(tokens["input_ids"].numpy(), tokens["attention_mask"].numpy())]


class TextCache:
    """The text encoder's outputs of the rows an encode has written, by token sequence, up to
    ``max_bytes``: a later caption with the same tokens reuses them instead of another forward
    pass. What it holds depends only on the rows written before, in their order (each new
    sequence is added while it fits; nothing is evicted), so a resumed encode rebuilds it from
    its finished shards and writes exactly what an uninterrupted encode writes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: dict[bytes, dict[str, np.ndarray]] = {}
        self.nbytes = 0
        self.full = max_bytes <= 0

    def add(self, key: bytes, row: dict[str, np.ndarray]) -> None:
        """Keep ``row`` (one sample's text arrays) for ``key`` unless it is known or does not fit."""
        if self.full or key in self.entries:
            return
        size = sum(a.nbytes for a in row.values())
        if self.nbytes + size > self.max_bytes:
            self.full = True  # every row has the same size: nothing later fits either
            return
        self.entries[key] = {k: np.array(a) for k, a in row.items()}  # a copy: not a view of a whole batch
        self.nbytes += size


class Encoders:
    """The loaded VAE and text encoder and what the encode needs to know about them; the Ray
    encode's actors and online encoding load one each."""

    def __init__(self, cfg: EncodeConfig, device: str):
        text_dtype = cfg.text_dtype if cfg.text_dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
        self.vae = load_vae(cfg.vae, device=device)  # float32
        vae_fp = vae_fingerprint(self.vae)  # of the weights as stored, whatever the compute dtype
        if cfg.vae_dtype != "float32":
            self.vae.to(dtype=_DTYPES[cfg.vae_dtype])
        self.text, self.tokenizer = load_text_encoder(cfg.text_encoder, tokenizer=cfg.tokenizer)
        text_fp = text_encoder_fingerprint(self.text, self.tokenizer)
        # Set explicitly (after the fingerprint): encode_text, sampling and an exported pipeline follow it.
        self.text.config.use_attention_mask = (cfg.attention_mask == "on"
                                               or bool(getattr(self.text.config, "use_attention_mask", False)))
        self.text.to(device=device, dtype=_DTYPES[text_dtype])
        self.max_length = resolve_max_length(self.text, self.tokenizer, cfg.max_length)
        self.storage = np.dtype(cfg.storage_dtype)
        self.resolved = dataclasses.replace(cfg, max_length=self.max_length, text_dtype=text_dtype,
                                            tokenizer=cfg.tokenizer or cfg.text_encoder)
        # Local paths are recorded absolute: training, sampling and export read them from any directory.
        self.vae_info = {"path": absolute_if_local(cfg.vae), "fingerprint": vae_fp, **vae_meta(self.vae),
                         "dtype": cfg.vae_dtype}
        self.text_info = {"path": absolute_if_local(cfg.text_encoder),
                          "tokenizer_path": absolute_if_local(self.resolved.tokenizer),
                          "fingerprint": text_fp, **text_encoder_meta(self.text, self.tokenizer, self.max_length),
                          "dtype": text_dtype}

    def text_arrays(self, captions: Sequence[str]) -> dict[str, np.ndarray]:
        return self.token_arrays(self.tokenize(captions))

    def truncated(self, captions: Sequence[str]) -> np.ndarray:
        """Which of ``captions`` have more tokens than ``max_length`` (their embeddings see only
        the first ``max_length``; the shards keep the whole caption), as a bool array."""
        if not captions:
            return np.zeros(0, dtype=bool)
        ids = self.tokenizer(list(captions), truncation=False, verbose=False)["input_ids"]
        return np.array([len(x) > self.max_length for x in ids], dtype=bool)

    def tokenize(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """The tokens of ``captions`` for :meth:`token_arrays`. A fast tokenizer must not be called
        from two threads at once: while an encode runs, only its reader thread calls this."""
        return tokenize(self.tokenizer, captions, self.max_length)

    def token_arrays(self, tokens: dict[str, torch.Tensor], cache: TextCache | None = None) -> dict[str, np.ndarray]:
        """The text encoder's outputs for each row of ``tokens`` (in the storage dtype; the mask as
        uint8), with one forward pass over the distinct token sequences of the batch that are not
        in ``cache``: a row that repeats another reuses its output."""
        keys = token_keys(tokens)
        known = cache.entries if cache is not None else {}
        first: dict[bytes, int] = {}  # the first row of each sequence to encode
        for i, k in enumerate(keys):
            if k not in known:
                first.setdefault(k, i)
        new: dict[bytes, dict[str, np.ndarray]] = {}
        if first:
            idx = torch.tensor(list(first.values()))
            out = encode_tokens(self.text, {k: v[idx] for k, v in tokens.items()})
            arrays = {k: v.cpu().numpy() if k == "text_mask" else _to_storage(v, self.storage) for k, v in out.items()}
            if len(first) == len(keys):  # every row a new sequence: the arrays as they are
                return arrays
            new = {k: {name: a[j] for name, a in arrays.items()} for j, k in enumerate(first)}
        rows = [new[k] if k in new else known[k] for k in keys]
        return {name: np.stack([r[name] for r in rows]) for name in rows[0]}

    @torch.inference_mode()
    def latent_arrays(self, pixels: np.ndarray) -> dict[str, np.ndarray]:
        x = torch.from_numpy(pixels).to(device=self.vae.device, dtype=self.vae.dtype)
        dist = self.vae.encode(x).latent_dist
        return {"latent_mean": _to_storage(dist.mean, self.storage),
                "latent_std": _to_storage(dist.std, self.storage)}


def decode_batch(keys: Sequence[str], images: Sequence[bytes | None], resolution: int | tuple[int, int],
                 shard: str) -> tuple[list[int], np.ndarray | None, list[dict[str, str]]]:
    """Decode a batch of raw images: (indices of the good ones, their pixels stacked (n, 3, H, W)
    or None if none is good, rejection records of the others). ``resolution``: the side of a
    square dataset, or (width, height) of a bucket."""
    good, pixels, rejected = [], [], []
    for i, (key, data) in enumerate(zip(keys, images)):
        try:
            pixels.append(decode_image(data, resolution))
            good.append(i)
        except RejectedImage as e:
            rejected.append({"shard": shard, "key": key, "reason": e.reason, "detail": str(e)})
    return good, (np.stack(pixels) if pixels else None), rejected


def build_rows(raw: dict[str, Sequence[Any]], good: Sequence[int], arrays: dict[str, np.ndarray], shard: str,
               storage_dtype: np.dtype) -> tuple[list[dict[str, Any]], list[dict[str, str]], list[int]]:
    """Latent-shard rows of the good samples of a batch: ``raw`` holds the batch's key, caption,
    width and height lists, ``arrays`` the encoders' outputs for ``good`` (in that order).
    Samples with a non-finite value are rejected instead. Also returns the positions in ``good``
    of the rows kept."""
    rows, rejected, kept = [], [], []
    for j, i in enumerate(good):
        sample = {k: v[j] for k, v in arrays.items()}
        bad = [k for k, v in sample.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
        if bad:
            rejected.append({"shard": shard, "key": raw["key"][i], "reason": "non_finite",
                             "detail": f"{', '.join(bad)} not finite in {np.dtype(storage_dtype).name}"})
            continue
        rows.append({"key": raw["key"][i], "caption": raw["caption"][i], "width": raw["width"][i],
                     "height": raw["height"][i], **sample})
        kept.append(j)
    return rows, rejected, kept


def shard_record(out: Path, name: str, seen: int, info: ShardInfo, rejected: list[dict[str, str]],
                 truncated: int = 0) -> dict:
    """Write the completion record of shard ``name`` (after its file) and return it; ``truncated``:
    its captions longer than the text encoder's max_length."""
    done = {"name": name, "seen": seen, "written": info.num_samples, "num_bytes": info.num_bytes,
            "rejected": rejected, "truncated": truncated}
    storage.atomic_write_bytes(out / PROGRESS / f"{name}.json", json.dumps(done).encode())
    return done


@dataclass
class _Prepared:
    """One batch of a raw shard made ready for the encoders (by :func:`_prepare`, in the
    encode's reader thread): the good images' pixels and caption tokens, and the rejected ones."""

    batch: dict[str, list[Any]]  # the raw columns of the batch
    good: list[int]  # indices into the batch of the decodable images
    pixels: np.ndarray | None
    tokens: dict[str, torch.Tensor] | None
    rejected: list[dict[str, str]]
    truncated: int  # good captions longer than the encoder's max_length


def _prepare(enc: Encoders, batch: dict[str, list[Any]], size: tuple[int, int], shard: str) -> _Prepared:
    good, pixels, rejected = decode_batch(batch["key"], batch["image"], size, shard)
    captions = [batch["caption"][i] for i in good]
    tokens = enc.tokenize(captions) if good else None
    return _Prepared(batch, good, pixels, tokens, rejected, int(enc.truncated(captions).sum()))


# Batches decoded and tokenised ahead of the encoders' forward pass (in one reader thread, which
# Pillow, numpy and the tokenizer let run beside the forward pass): 2 keep the forward pass fed
# while holding at most 2 batches of pixels more in memory.
PREFETCH_BATCHES = 2


def _encode_shard(raw_uri: str, out: Path, name: str, enc: Encoders, columns: dict[str, str],
                  size: tuple[int, int], batch_size: int, bar: tqdm, bucket: bool,
                  stop: StopOnSignal | None = None, reader: ThreadPoolExecutor | None = None,
                  cache: TextCache | None = None) -> dict:
    """Encode one raw shard into ``out/name`` and write its completion record; ``bucket``: keep
    only the rows of the (width, height) ``size`` (the others belong to other buckets);
    ``reader``: a one-thread pool that decodes and tokenises the next batches during the forward
    pass of this one (None: in this thread, in turn); ``cache``: the text outputs of the rows
    written before, used and added to."""
    table = read_shard(raw_uri, columns=list(RAW_NEEDED))
    raw = {c: table.column(c).to_pylist() for c in RAW_NEEDED}
    if bucket:
        mine = [i for i, wh in enumerate(zip(raw["width"], raw["height"])) if wh == size]
        bar.update(len(raw["key"]) - len(mine))
        raw = {c: [v[i] for i in mine] for c, v in raw.items()}
    n = len(raw["key"])
    batches = ({c: v[start:start + batch_size] for c, v in raw.items()} for start in range(0, n, batch_size))
    if reader is None:
        prepared: Iterator[_Prepared] = (_prepare(enc, b, size, name) for b in batches)
    else:
        prepared = _ahead(reader, lambda b: _prepare(enc, b, size, name), batches, PREFETCH_BATCHES)
    rows: list[dict[str, Any]] = []
    rejected: list[dict[str, str]] = []
    truncated = 0
    for p in prepared:
        if stop is not None and stop.requested:
            raise _Stopped()
        rejected += p.rejected
        truncated += p.truncated
        if p.good:
            text = enc.token_arrays(p.tokens, cache)
            ok, bad, kept = build_rows(p.batch, p.good, {**enc.latent_arrays(p.pixels), **text}, name, enc.storage)
            rows += ok
            rejected += bad
            if cache is not None and not cache.full:
                keys = token_keys(p.tokens)
                for j in kept:
                    cache.add(keys[j], {k: v[j] for k, v in text.items()})
        bar.update(len(p.batch["key"]))
    return shard_record(out, name, n, write_shard(out / name, rows, columns), rejected, truncated)


def _ahead(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: Iterable[Any], depth: int) -> Iterator[Any]:
    """``fn(item)`` of each item in order, computed in ``pool`` up to ``depth`` items ahead of
    the consumer. A consumer that stops early leaves at most ``depth`` calls to finish."""
    pending: collections.deque[Future] = collections.deque()
    items = iter(items)
    for item in itertools.islice(items, depth):
        pending.append(pool.submit(fn, item))
    while pending:
        result = pending.popleft().result()  # re-raises an exception of fn here, in order
        for item in itertools.islice(items, 1):
            pending.append(pool.submit(fn, item))
        yield result


@dataclass
class EncodeJob:
    """An encode set up and checked, before any shard is encoded: the output directory is
    claimed, its config, meta and empty-prompt file are written."""

    raw_dir: str
    raw: DatasetIndex
    out: Path
    cfg: EncodeConfig
    enc: Encoders
    resolution: int  # of the raw dataset (its square side, or the base side of its buckets)
    size: tuple[int, int]  # (width, height) of the images this job encodes
    bucket: bool  # True: one aspect-ratio bucket of a bucketed raw dataset
    columns: dict[str, str]
    meta: dict[str, Any]

    def finished(self, name: str) -> dict | None:
        """The completion record of output shard ``name``, or None if it has to be (re)encoded."""
        return _finished_shard(self.out, name)


def open_encode(raw_dir: str, out_dir: str | Path, cfg: EncodeConfig) -> EncodeJob:
    """Check the inputs, load the encoders, and claim ``out_dir`` (see :class:`EncodeJob`) for a
    square raw dataset (:func:`encode_dataset` also encodes aspect-ratio buckets)."""
    cfg.validate()
    cfg.require_models()
    raw = read_index(raw_dir)
    resolution = _check_raw(raw_dir, raw)
    if raw.meta.get("crop") == "buckets":
        raise UserError(f"{raw_dir}: holds aspect-ratio buckets: encode it without --ray (one latent dataset "
                        "per bucket)")
    return _claim(raw_dir, raw, resolution, out_dir, cfg, Encoders(cfg, _resolve_device(cfg.device)), None)


def _claim(raw_dir: str, raw: DatasetIndex, resolution: int, out_dir: str | Path, cfg: EncodeConfig,
           enc: Encoders, bucket: tuple[int, int] | None,
           take_lock: Callable[[Path], None] = lambda out: None) -> EncodeJob:
    """Claim ``out_dir`` for the checked raw dataset ``raw``: write its meta, config and
    empty-prompt file (``take_lock(out_dir)`` first). ``bucket``: the (width, height) of one
    aspect-ratio bucket (None: the whole square dataset)."""
    if bucket is None and resolution % enc.vae_info["downsample_factor"]:
        raise UserError(f"{raw_dir}: resolution {resolution} is not a multiple of the VAE's "
                        f"downsample factor {enc.vae_info['downsample_factor']}")
    size = bucket or (resolution, resolution)
    out = Path(out_dir)
    source_fp = hashlib.sha256(storage.read_bytes(storage.join(raw_dir, INDEX))).hexdigest()
    meta = {
        "resolution": resolution,
        **({"bucket": list(size)} if bucket else {}),
        "vae": enc.vae_info,
        "text_encoder": enc.text_info,
        "storage_dtype": cfg.storage_dtype,
        "source_dataset": {"path": raw_dir, "fingerprint": source_fp, "num_samples": raw.num_samples},
    }
    _open_out_dir(out, meta, take_lock)
    save_config(enc.resolved, out / CONFIG_FILE)

    empty = {k: v[0] for k, v in enc.text_arrays([""]).items()}
    storage.atomic_write_bytes(out / EMPTY_PROMPT, safetensors.numpy.save(empty))
    return EncodeJob(raw_dir, raw, out, cfg, enc, resolution, size, bucket is not None,
                     latent_columns(enc, size, empty), meta)


def latent_columns(enc: Encoders, size: int | tuple[int, int], empty: dict[str, np.ndarray]) -> dict[str, str]:
    """The column types of the latent shards ``enc`` writes for images of ``size`` (a square
    side or (width, height)); ``empty``: the text arrays of one caption, for their shapes."""
    width, height = (size, size) if isinstance(size, int) else size
    factor = enc.vae_info["downsample_factor"]
    latent_type = ndarray_type(enc.storage, (enc.vae_info["latent_channels"], height // factor, width // factor))
    return {"key": "str", "caption": "str", "width": "int64", "height": "int64",
            "latent_mean": latent_type, "latent_std": latent_type,
            **{k: ndarray_type(v.dtype, v.shape) for k, v in empty.items()}}


def finish_encode(job: EncodeJob, records: list[dict]) -> dict:
    """Write rejected.jsonl, summary.json and, last, index.json from the shards' records (in
    raw shard order); returns the summary."""
    out = job.out
    rejected = [r for done in records for r in done["rejected"]]
    storage.atomic_write_bytes(out / REJECTED, "".join(json.dumps(r) + "\n" for r in rejected).encode())
    summary = {"seen": sum(d["seen"] for d in records), "written": sum(d["written"] for d in records),
               "rejected": dict(collections.Counter(r["reason"] for r in rejected))}
    truncated = sum(d.get("truncated", 0) for d in records)
    if truncated:  # kept, with their whole caption in the shards; their embeddings saw max_length tokens
        summary["truncated_captions"] = truncated
    storage.atomic_write_bytes(out / SUMMARY, json.dumps(summary, indent=1).encode())
    shards = [ShardInfo(name=d["name"], num_samples=d["written"], num_bytes=d["num_bytes"]) for d in records]
    write_index(out, DatasetIndex(kind="latent", columns=job.columns, shards=shards, meta=job.meta))
    return summary


def _run_job(job: EncodeJob, progress: bool, stop: StopOnSignal | None = None) -> dict:
    """Encode the shards of ``job`` not finished by an earlier run, in this process."""
    records = []
    desc = f"encode {job.size[0]}x{job.size[1]}" if job.bucket else "encode"
    cache = TextCache(job.cfg.text_cache_mb * 2**20)
    with (tqdm(total=job.raw.num_samples, unit="img", desc=desc, disable=not progress) as bar,
          ThreadPoolExecutor(1, thread_name_prefix="encode-reader") as reader):
        for shard in job.raw.shards:
            done = job.finished(shard.name)
            if done is None:
                done = _encode_shard(storage.join(job.raw_dir, shard.name), job.out, shard.name, job.enc,
                                     job.columns, job.size, job.cfg.batch_size, bar, job.bucket, stop, reader,
                                     cache)
            else:
                if not cache.full:  # as an uninterrupted encode would hold it after this shard
                    reader.submit(_recall, job, shard.name, cache).result()
                bar.update(done["seen"])
            records.append(done)
    return finish_encode(job, records)


def _recall(job: EncodeJob, name: str, cache: TextCache) -> None:
    """Add the text outputs of the finished output shard ``name`` to ``cache``, in row order (in
    the reader thread: the tokenizer's only caller)."""
    text = [c for c in job.columns if c.startswith("text_")]
    table = read_shard(str(job.out / name), columns=["caption", *text])
    captions = table.column("caption").to_pylist()
    values = {c: table.column(c).to_pylist() for c in text}
    step = job.cfg.batch_size
    for start in range(0, len(captions), step):
        keys = token_keys(job.enc.tokenize(captions[start:start + step]))
        for j, key in enumerate(keys, start):
            cache.add(key, {c: decode_value(values[c][j], job.columns[c]) for c in text})
            if cache.full:
                return


def encode_dataset(raw_dir: str, out_dir: str, cfg: EncodeConfig, progress: bool = True,
                   encoders: Encoders | None = None, lock: str = "") -> dict:
    """Encode the raw dataset at ``raw_dir`` (local or s3://) into latent shards in ``out_dir``
    (one latent dataset per bucket for a bucketed raw dataset, see the module docstring).

    Returns the summary ``{"seen", "written", "rejected": {reason: count}}`` (also written to
    ``out_dir/summary.json``); shards finished by an earlier run with the same inputs are kept.
    Stopped by a signal (see the module docstring) it returns ``{"interrupted": signal name}``.
    ``encoders``: already loaded from ``cfg`` (by default they are loaded here).
    ``lock``: the command's name (e.g. "latentforge encode"): ``out_dir``'s lock is held from the
    first write there (:func:`latentforge.storage.directory_lock`), so a second encode into it stops
    in one line.
    """
    with StopOnSignal(cfg.interrupt, what="encode",
                      stopping="stopping after the current batch: the finished shards are kept") as stop, \
            storage.lock_at_first_write(lock) as take_lock:
        try:
            return _encode_dataset(raw_dir, out_dir, cfg, progress, stop, encoders, take_lock)
        except _Stopped:
            return {"interrupted": stop.signal_name}


def _encode_dataset(raw_dir: str, out_dir: str, cfg: EncodeConfig, progress: bool, stop: StopOnSignal,
                    enc: Encoders | None, take_lock: Callable[[Path], None]) -> dict:
    cfg.validate()
    cfg.require_models()
    raw = read_index(raw_dir)
    resolution = _check_raw(raw_dir, raw)
    enc = enc or Encoders(cfg, _resolve_device(cfg.device))
    if raw.meta.get("crop") != "buckets":
        return _run_job(_claim(raw_dir, raw, resolution, out_dir, cfg, enc, None, take_lock), progress, stop)
    factor = enc.vae_info["downsample_factor"]
    sizes: collections.Counter = collections.Counter()
    for shard in raw.shards:
        t = read_shard(storage.join(raw_dir, shard.name), columns=["width", "height"])
        sizes.update(zip(t.column("width").to_pylist(), t.column("height").to_pylist()))
    bad = [f"{w}x{h}" for w, h in sizes if w % factor or h % factor]
    if bad:
        raise UserError(f"{raw_dir}: bucket size(s) {', '.join(bad)} are not multiples of the VAE's downsample "
                        f"factor {factor}")
    out = Path(out_dir)
    storage.refuse_foreign_dir(out, (f"{PROGRESS}/buckets",), "bucketed encode output")
    out.mkdir(parents=True, exist_ok=True)
    take_lock(out)  # the whole of it: every bucket's directory is inside
    storage.atomic_write_bytes(out / PROGRESS / "buckets", b"")
    (out / BUCKETS).unlink(missing_ok=True)  # the completion marker of the whole, rewritten last
    buckets, summaries = [], []
    for (w, h) in sorted(sizes):
        name = f"bucket-{w}x{h}"
        summaries.append(_run_job(_claim(raw_dir, raw, resolution, out / name, cfg, enc, (w, h)), progress, stop))
        buckets.append({"path": name, "width": w, "height": h, "num_samples": summaries[-1]["written"]})
    rejected: collections.Counter = collections.Counter()
    for sm in summaries:
        rejected.update(sm["rejected"])
    summary = {"seen": sum(sm["seen"] for sm in summaries), "written": sum(sm["written"] for sm in summaries),
               "rejected": dict(rejected), "buckets": {b["path"]: b["num_samples"] for b in buckets}}
    truncated = sum(sm.get("truncated_captions", 0) for sm in summaries)
    if truncated:
        summary["truncated_captions"] = truncated
    storage.atomic_write_bytes(out / SUMMARY, json.dumps(summary, indent=1).encode())
    storage.atomic_write_bytes(out / BUCKETS, json.dumps({"resolution": resolution, "buckets": buckets},
                                                         indent=1).encode())
    return summary
