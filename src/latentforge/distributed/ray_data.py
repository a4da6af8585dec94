"""Encoding on Ray: ``latentforge encode --ray`` (a Ray Data pipeline) and online encoding for training.

``encode --ray`` writes exactly what :func:`latentforge.data.encode.encode_dataset` writes (same
shards, same sample order, same ``index.json`` meta; values equal up to float rounding, since the
encoders see other batch compositions), and is resumable per shard the same way::

    chunks (one per raw row group)  --CPU tasks-->  decoded pixels + captions
        --actor pool (VAE + text encoder, one copy per actor, GPU if any)-->  latents + text arrays
        --streamed in order to the driver-->  ShardWriter per output shard + completion record

Ray Data keeps the input order (``preserve_order``), so the driver sees the samples in raw shard
order and writes each latent shard as soon as its last sample arrives. The pipeline streams: it
is iterated once, so nothing runs twice and no ``materialize()`` is needed.

Online encoding (:class:`OnlineSource`) trains on raw shards: the training loader reads raw
samples in exactly the order it would read the latent shards of the same dataset (same shard
sizes, same seed), and Ray actors encode each micro batch while the trainer works on earlier ones.
Caption dropout replaces the caption by "" before encoding, which gives the empty-prompt
conditioning the latent loader substitutes. A rejected image stops training (skipping it would
shift the order): run the encode's filters first (``ingest`` already decodes every image).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from latentforge import storage
from latentforge.data.encode import (
    PROGRESS,
    RAW_NEEDED,
    EncodeConfig,
    Encoders,
    build_rows,
    decode_batch,
    finish_encode,
    latent_columns,
    open_encode,
    shard_record,
)
from latentforge.data.loader import LoaderConfig, TrainLoader, build_loader
from latentforge.data.schema import INDEX, DatasetIndex, ShardWriter, read_index, read_shard, write_shard
from latentforge.distributed.ray_cluster import RayConfig, ray_session
from latentforge.errors import UserError
from latentforge.interrupt import StopOnSignal

log = logging.getLogger(__name__)

_DECODE_CPUS = 0.25  # per decode task: a share small enough that it always fits next to the actors


def actor_resources(cfg: RayConfig, num_actors: int, cluster: dict[str, float]) -> dict[str, float]:
    """``num_cpus``/``num_gpus`` of each encoder actor: 1 GPU each if the cluster has GPUs (or
    ``cfg.gpus_per_worker``); CPUs from ``cfg.cpus_per_worker``, else 1 on a cluster, else the
    cores less half a core for the decode tasks, shared out (MACHINE-NOTES: whole-CPU actors on
    a 2-core instance leave the read tasks no CPU and the pipeline hangs)."""
    gpus = cfg.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if cluster.get("GPU", 0) > 0 else 0.0
    cpus = cfg.cpus_per_worker
    if cpus is None:
        cpus = 1.0 if cfg.address else min(1.0, max(0.05, (cluster.get("CPU", 1) - 0.5) / num_actors))
    return {"num_cpus": cpus, "num_gpus": gpus}


class EncoderActor:
    """One VAE + text encoder per actor. Checks that it loaded the same weights as the driver
    (on a cluster every node reads the model paths itself)."""

    def __init__(self, cfg: dict[str, Any], fingerprints: tuple[str, str], resolution: int, num_threads: int):
        from latentforge.config import from_dict

        torch.set_num_threads(num_threads)
        self.cfg = from_dict(EncodeConfig, cfg)
        device = "cuda" if torch.cuda.is_available() and self.cfg.device != "cpu" else "cpu"
        self.enc = Encoders(self.cfg, device)
        got = (self.enc.vae_info["fingerprint"], self.enc.text_info["fingerprint"])
        if got != tuple(fingerprints):
            raise UserError(f"encoder actor on {os.uname().nodename}: {self.cfg.vae} / {self.cfg.text_encoder} hold "
                            "other weights than on the driver: every node must see the same model files")
        self.resolution = resolution
        empty = self.enc.text_arrays([""])
        side = resolution // self.enc.vae_info["downsample_factor"]
        latent = np.zeros((self.enc.vae_info["latent_channels"], side, side), self.enc.storage)
        self.templates = {"latent_mean": latent, "latent_std": latent, **{k: v[0] for k, v in empty.items()}}

    def arrays(self, pixels: np.ndarray | None, captions: list[str], ok: np.ndarray) -> dict[str, np.ndarray]:
        """Encoder outputs for all rows (zeros where ``ok`` is False)."""
        n = len(ok)
        out = {k: np.zeros((n, *v.shape), v.dtype) for k, v in self.templates.items()}
        idx = np.flatnonzero(ok)
        if idx.size:
            got = {**self.enc.latent_arrays(pixels), **self.enc.text_arrays([captions[i] for i in idx])}
            for k, v in got.items():
                out[k][idx] = v
        return out

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Ray Data: a batch of decoded rows -> the same rows with the encoders' outputs."""
        ok = batch["ok"].astype(bool)
        pixels = batch["pixels"][ok] if ok.any() else None
        captions = [str(c) for c in batch["caption"]]
        arrays = self.arrays(pixels, captions, ok)
        # Counted here, in the actors, as the local encode counts them in its reader thread (not in the driver).
        truncated = np.zeros(len(ok), dtype=bool)
        truncated[ok] = self.enc.truncated([captions[i] for i in np.flatnonzero(ok)])
        return {**{k: v for k, v in batch.items() if k != "pixels"}, **arrays, "truncated": truncated}

    def encode_raw(self, keys: list[str], images: list[bytes], captions: list[str]) -> dict[str, np.ndarray]:
        """Online encoding: raw image bytes and captions of one micro batch -> encoder outputs;
        any image that cannot be decoded is an error."""
        good, pixels, rejected = decode_batch(keys, images, self.resolution, "online")
        if rejected:
            r = rejected[0]
            raise UserError(f"online encoding: sample {r['key']} was rejected ({r['reason']}: {r['detail']}); "
                            "training needs every sample: filter the raw dataset or encode it offline")
        arrays = self.arrays(pixels, captions, np.ones(len(keys), dtype=bool))
        bad = [k for k, v in arrays.items() if v.dtype.kind == "f" and not np.isfinite(v).all()]
        if bad:
            raise UserError(f"online encoding: {', '.join(bad)} not finite for one of {keys[:3]}...")
        return arrays


# ---------------------------------------------------------------------------------------------
# encode --ray


def _chunks(raw_dir: str, name: str) -> list[dict[str, Any]]:
    """The decode tasks of one raw shard: one per parquet row group (local), or the whole shard
    (S3: one download per task)."""
    uri = storage.join(raw_dir, name)
    if storage.is_s3(uri):
        return [{"shard": name, "uri": uri, "group": -1}]
    return [{"shard": name, "uri": uri, "group": g} for g in range(pq.read_metadata(uri).num_row_groups)]


def _read_and_decode(batch: dict[str, np.ndarray], resolution: int) -> dict[str, np.ndarray]:
    """Ray Data task: chunks -> their raw rows with decoded pixels (zeros where rejected)."""
    cols: dict[str, list] = collections.defaultdict(list)
    pixels = []
    for name, uri, group in zip(batch["shard"], batch["uri"], batch["group"]):
        if group < 0:
            table = read_shard(str(uri), columns=list(RAW_NEEDED))
        else:
            table = pq.ParquetFile(str(uri)).read_row_group(int(group), columns=list(RAW_NEEDED))
        raw = {c: table.column(c).to_pylist() for c in RAW_NEEDED}
        good, px, rejected = decode_batch(raw["key"], raw["image"], resolution, str(name))
        why = {r["key"]: r for r in rejected}
        full = np.zeros((len(raw["key"]), 3, resolution, resolution), np.float32)
        if good:
            full[good] = px
        pixels.append(full)
        for c in ("key", "caption", "width", "height"):
            cols[c] += raw[c]
        cols["shard"] += [str(name)] * len(raw["key"])
        cols["ok"] += [k not in why for k in raw["key"]]
        cols["reason"] += [why[k]["reason"] if k in why else "" for k in raw["key"]]
        cols["detail"] += [why[k]["detail"] if k in why else "" for k in raw["key"]]
    out = {c: np.asarray(v, dtype=object if c in ("key", "caption", "shard", "reason", "detail") else None)
           for c, v in cols.items()}
    out["pixels"] = np.concatenate(pixels) if pixels else np.zeros((0, 3, resolution, resolution), np.float32)
    return out


class _ShardSink:
    """Writes the encoded rows of one output shard as they stream in (row groups), then its
    completion record."""

    def __init__(self, out: Path, name: str, columns: dict[str, str], expected: int):
        self.out, self.name, self.expected = out, name, expected
        self.writer = ShardWriter(out / name, columns)
        self.seen = 0
        self.truncated = 0  # good captions longer than the text encoder's max_length, as encode counts them
        self.rejected: list[dict[str, str]] = []

    def add(self, batch: dict[str, np.ndarray], idx: np.ndarray, enc: Encoders) -> None:
        raw = {c: batch[c][idx].tolist() for c in ("key", "caption", "width", "height")}
        ok = batch["ok"][idx].astype(bool)
        for i in np.flatnonzero(~ok):
            self.rejected.append({"shard": self.name, "key": raw["key"][i], "reason": str(batch["reason"][idx[i]]),
                                  "detail": str(batch["detail"][idx[i]])})
        good = np.flatnonzero(ok)
        arrays = {k: batch[k][idx[good]] for k in batch
                  if k not in raw and k not in ("shard", "ok", "reason", "detail", "truncated")}
        rows, bad, _ = build_rows(raw, good.tolist(), arrays, self.name, enc.storage)
        self.truncated += int(batch["truncated"][idx[good]].sum())
        for row in rows:
            self.writer.write(row)
        self.rejected += bad
        self.seen += len(idx)

    def close(self) -> dict:
        if self.seen != self.expected:
            self.writer.abort()
            raise UserError(f"{self.name}: the Ray encode delivered {self.seen} of {self.expected} samples")
        return shard_record(self.out, self.name, self.seen, self.writer.close(), self.rejected, self.truncated)


def encode_on_ray(raw_dir: str, out_dir: str, cfg: EncodeConfig, ray_cfg: RayConfig, num_actors: int = 1,
                  progress: bool = True) -> dict:
    """:func:`~latentforge.data.encode.encode_dataset` as a Ray Data pipeline with ``num_actors``
    encoder actors (see the module docstring). Returns the same summary; stopped by a signal as
    ``encode`` is (between two batches: the finished shards kept, the shard in progress encoded
    again by the rerun) it returns ``{"interrupted": signal name}``."""
    if num_actors < 1:
        raise UserError(f"--num-actors: must be >= 1, got {num_actors}")
    ray_cfg.validate()
    job = open_encode(raw_dir, out_dir, cfg)
    records: dict[str, dict] = {s.name: d for s in job.raw.shards if (d := job.finished(s.name)) is not None}
    for s in job.raw.shards:  # an empty raw shard gives an empty latent shard, as in encode_dataset
        if s.name not in records and s.num_samples == 0:
            records[s.name] = shard_record(job.out, s.name, 0, write_shard(job.out / s.name, [], job.columns), [])
    todo = [s for s in job.raw.shards if s.name not in records]
    stop = StopOnSignal(cfg.interrupt, what="encode --ray",
                        stopping="stopping after the current batch: the finished shards are kept")
    if todo:
        # Ray's temp dir (logs, sockets) of a local instance goes in the hidden progress directory.
        with ray_session(ray_cfg, job.out / PROGRESS, quiet=not progress) as ray:
            from ray.data import ActorPoolStrategy, DataContext

            ctx = DataContext.get_current()
            ctx.execution_options.preserve_order = True  # the driver writes shards in raw order
            ctx.enable_progress_bars = progress
            res = actor_resources(ray_cfg, num_actors, ray.cluster_resources())
            items = [c for s in todo for c in _chunks(raw_dir, s.name)]
            fingerprints = (job.enc.vae_info["fingerprint"], job.enc.text_info["fingerprint"])
            ds = (ray.data.from_items(items, override_num_blocks=len(items))
                  .map_batches(_read_and_decode, batch_size=1, fn_kwargs={"resolution": job.resolution},
                               num_cpus=_DECODE_CPUS)
                  .map_batches(EncoderActor, batch_size=cfg.batch_size, batch_format="numpy",
                               compute=ActorPoolStrategy(size=num_actors),
                               fn_constructor_args=(dataclasses.asdict(cfg), fingerprints, job.resolution,
                                                    max(1, int(res["num_cpus"]))),
                               num_cpus=res["num_cpus"], num_gpus=res["num_gpus"]))
            expected = {s.name: s.num_samples for s in todo}
            sink: _ShardSink | None = None
            with tqdm(total=sum(expected.values()), unit="img", desc="encode (ray)", disable=not progress) as bar, \
                    stop:  # entered after ray.init, so that the signals reach this handler, not Ray's
                for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                    shards = batch["shard"]
                    starts = [0] + [i for i in range(1, len(shards)) if shards[i] != shards[i - 1]] + [len(shards)]
                    for a, b in zip(starts[:-1], starts[1:]):
                        name = str(shards[a])
                        if sink is None or sink.name != name:
                            if sink is not None:
                                records[sink.name] = sink.close()
                            sink = _ShardSink(job.out, name, job.columns, expected[name])
                        sink.add(batch, np.arange(a, b), job.enc)
                        bar.update(b - a)
                    if stop.requested:  # between two batches: keep the finished shards, drop the one in progress
                        break
                if sink is not None and (not stop.requested or sink.seen == sink.expected):
                    records[sink.name] = sink.close()
                elif sink is not None:
                    sink.writer.abort()  # its parquet never appears, so the rerun encodes it again
    if stop.requested and any(s.name not in records for s in job.raw.shards):  # else only the index is left
        return {"interrupted": stop.signal_name}
    missing = [s.name for s in job.raw.shards if s.name not in records]
    if missing:
        raise UserError(f"{raw_dir}: the Ray encode produced no rows of shard(s) {', '.join(missing[:3])}")
    return finish_encode(job, [records[s.name] for s in job.raw.shards])


# ---------------------------------------------------------------------------------------------
# Online encoding


class OnlineLoader:
    """A :class:`~latentforge.data.loader.TrainLoader` over raw shards whose batches are encoded
    by Ray actors: the same batch dicts (``latent_mean``, ``latent_std``, ``text_hidden``,
    ``text_mask``, ..., ``_position``, ``_dataset``, ``_caption_dropped``) in the same global order
    as a loader over the encoded shards. ``ahead`` micro batches are being encoded while the
    trainer works; ``cursor`` counts only the batches handed out, so a checkpoint taken between
    steps resumes exactly."""

    def __init__(self, raw: TrainLoader, actors: list[Any], ahead: int = 2):
        self.raw = raw
        self.actors = actors
        self.ahead = max(1, ahead)
        self.cursor = raw.cursor
        self._generation = 0

    @property
    def global_batch_size(self) -> int:
        return self.raw.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        return self.raw.samples_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {**self.raw.state_dict(), "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.raw.load_state_dict(state)  # checks the state (seed, data fingerprint, cursor)
        self.start_at(self.raw.cursor)

    def start_at(self, cursor: int) -> None:
        """:meth:`TrainLoader.start_at`."""
        self.raw.start_at(cursor)
        self._generation += 1
        self.cursor = self.raw.cursor

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._generation += 1
        self.raw.cursor = self.cursor  # batches encoded ahead but not handed out are read again
        return self._batches(self._generation)

    def _batches(self, generation: int) -> Iterator[dict[str, Any]]:
        import ray

        raw_batches = iter(self.raw)
        pending: collections.deque = collections.deque()
        submitted = 0

        def submit() -> None:
            nonlocal submitted
            b = next(raw_batches)
            actor = self.actors[submitted % len(self.actors)]
            pending.append((b, actor.encode_raw.remote(b["key"], b["image"], b["caption"])))
            submitted += 1

        for _ in range(self.ahead):
            submit()
        while generation == self._generation:
            b, ref = pending.popleft()
            submit()
            try:
                arrays = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                cause = e.cause if isinstance(getattr(e, "cause", None), UserError) else None
                if cause is not None:
                    raise cause from None
                raise
            batch = {"key": b["key"], "caption": b["caption"], "width": b["width"], "height": b["height"],
                     **{k: torch.from_numpy(np.array(v)) for k, v in arrays.items()},  # ray.get gives read-only views
                     "_position": b["_position"], "_dataset": b["_dataset"], "_caption_dropped": b["_caption_dropped"]}
            self.cursor += self.global_batch_size
            yield batch

    def close(self) -> None:
        self._generation += 1
        self.raw.close()


class OnlineSource:
    """A :class:`latentforge.train.run.DataSource` whose phases list raw datasets, encoded online by
    ``num_actors`` Ray actors (started on first use in the connected Ray instance). ``read_index``
    describes a raw dataset as the latent dataset the offline encode would make of it (columns,
    shard sizes, meta with the encoders' fingerprints), so the run's checks and saved data meta
    are those of precomputed latents."""

    def __init__(self, cfg: EncodeConfig, num_actors: int = 1, ray_cfg: RayConfig | None = None):
        cfg.validate()
        cfg.require_models()
        if num_actors < 1:
            raise UserError(f"--num-actors: must be >= 1, got {num_actors}")
        self.cfg = cfg
        self.num_actors = num_actors
        self.ray_cfg = ray_cfg or RayConfig()
        self._enc: Encoders | None = None
        self._actors: dict[int, list[Any]] = {}

    def encoders(self) -> Encoders:
        if self._enc is None:
            self._enc = Encoders(self.cfg, "cpu")  # meta and fingerprints only; the actors encode
        return self._enc

    def read_index(self, path: str) -> DatasetIndex:
        raw = read_index(path)
        if raw.kind != "raw":
            raise UserError(f"{path}: online encoding reads raw shards (from ingest), this is {raw.kind!r}")
        resolution = raw.meta.get("resolution")
        enc = self.encoders()
        empty = {k: v[0] for k, v in enc.text_arrays([""]).items()}
        meta = {"resolution": resolution, "vae": enc.vae_info, "text_encoder": enc.text_info,
                "storage_dtype": self.cfg.storage_dtype,
                "source_dataset": {"path": path, "num_samples": raw.num_samples, "fingerprint": hashlib.sha256(
                    storage.read_bytes(storage.join(path, INDEX))).hexdigest()}}
        return DatasetIndex(kind="latent", columns=latent_columns(enc, resolution, empty), shards=raw.shards,
                            meta=meta)

    def _actors_for(self, resolution: int) -> list[Any]:
        if resolution not in self._actors:
            import ray

            enc = self.encoders()
            res = actor_resources(self.ray_cfg, self.num_actors, ray.cluster_resources())
            cls = ray.remote(num_cpus=res["num_cpus"], num_gpus=res["num_gpus"])(EncoderActor)
            fingerprints = (enc.vae_info["fingerprint"], enc.text_info["fingerprint"])
            self._actors[resolution] = [
                cls.remote(dataclasses.asdict(self.cfg), fingerprints, resolution, max(1, int(res["num_cpus"])))
                for _ in range(self.num_actors)]
        return self._actors[resolution]

    def build_loader(self, cfg: LoaderConfig, micro_batch_size: int, rank: int = 0,
                     world_size: int = 1) -> OnlineLoader:
        raw = build_loader(cfg, micro_batch_size, rank=rank, world_size=world_size)
        resolution = {read_index(d.path).meta.get("resolution") for d in cfg.datasets}
        if len(resolution) != 1:
            raise UserError(f"online encoding: the datasets of a phase have resolutions {sorted(resolution)}; "
                            "mix datasets of one resolution")
        return OnlineLoader(raw, self._actors_for(resolution.pop()))
