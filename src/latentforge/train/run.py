"""``train(config)``: build the denoiser, loaders and trainer from a config and run it.

This is the one entry point every launcher calls (a plain process, torchrun, Ray Train). It
checks the config against the latent datasets (latent channels and size, text hidden size, one
VAE and one text encoder across all phases), saves the resolved config and the data meta in the
run directory (sampling and export read them from there), and resumes from the newest complete
checkpoint when asked.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from latentforge import checkpoint as ckpt
from latentforge.config import save_config
from latentforge.data.buckets import bucketed_index, build_bucket_loader, is_bucketed
from latentforge.data.loader import LoaderConfig, build_loader
from latentforge.data.schema import parse_ndarray, read_index
from latentforge.errors import ConfigError, UserError
from latentforge.evaluate.during_training import training_evaluator
from latentforge.inference import training_sampler
from latentforge.interrupt import StopOnSignal
from latentforge.models.denoiser import denoiser_for, denoiser_from_config, denoiser_of
from latentforge.models.unet import UNetConfig
from latentforge.distributed.env import World
from latentforge.distributed.parallelize import parallelize, resolve_strategy
from latentforge.storage import lock_at_first_write
from latentforge.train import finetune
from latentforge.train.masking import check_kept_tokens
from latentforge.train.memory import resolve_auto_micro_batch
from latentforge.train.run_files import DATA_META, TRAIN_CONFIG, RunConfig
from latentforge.train.trainer import Trainer, TrainConfig, phase_batches
from latentforge.train.validation import load_validation_set

log = logging.getLogger(__name__)

@dataclass
class DataSource:
    """How a run reads its phases' datasets: precomputed latent shards (the default), or e.g.
    raw shards encoded online (``distributed/ray_data.py``). ``read_index(path)`` must describe
    a dataset as latent shards; ``build_loader(cfg, micro_batch_size, rank, world_size)`` returns
    a loader with TrainLoader's interface."""

    read_index: Callable[[str], Any] = read_index
    build_loader: Callable[..., Any] = build_loader


def latent_meta(cfg: TrainConfig, source: DataSource | None = None) -> dict[str, Any]:
    """The meta of the phases' latent datasets, checked to agree with each other and the U-Net."""
    if not cfg.phases:
        raise ConfigError("train.phases: empty: add at least one phase with datasets and steps")
    source = source or DataSource()
    first: dict[str, Any] | None = None
    for i, phase in enumerate(cfg.phases):
        if not phase.datasets:
            raise ConfigError(f"train.phases[{i}].datasets: empty: list the latent datasets of this phase")
        if len(phase.datasets) > 1 and any(is_bucketed(ds.path) for ds in phase.datasets):
            raise ConfigError(f"train.phases[{i}].datasets: a bucketed dataset must be the phase's only dataset")
        for j, ds in enumerate(phase.datasets):
            where = f"train.phases[{i}].datasets[{j}]"
            index, square = bucketed_index(ds.path) if is_bucketed(ds.path) else (source.read_index(ds.path), None)
            if index.kind != "latent":
                raise ConfigError(f"{where}.path: {ds.path} holds {index.kind!r} shards; train on encoded (latent) "
                                  "shards: run latentforge encode first")
            res = index.meta.get("resolution")
            if phase.resolution and res != phase.resolution:
                raise ConfigError(f"train.phases[{i}].resolution: {phase.resolution} but {ds.path} was encoded at {res}")
            meta = {
                "vae": index.meta["vae"],
                "text_encoder": index.meta["text_encoder"],
                # a bucketed dataset: the square latent of the same area (the U-Net's default size)
                "latent_shape": square or list(parse_ndarray(index.columns["latent_mean"])[1]),
                "text_shape": list(parse_ndarray(index.columns["text_hidden"])[1]),
                "resolution": res,
            }
            if first is None:
                first = meta
                continue
            for key in ("vae", "text_encoder"):
                if meta[key].get("fingerprint") != first[key].get("fingerprint"):
                    raise ConfigError(f"{where}.path: {ds.path} was encoded with another {key.replace('_', ' ')} "
                                      "than the first dataset; all phases must share one")
            if meta["text_shape"][-1] != first["text_shape"][-1] or meta["latent_shape"][0] != first["latent_shape"][0]:
                raise ConfigError(f"{where}.path: latent channels or text width differ from the first dataset")
    assert first is not None
    return first


def resolve_model_config(cfg: TrainConfig, meta: dict[str, Any], source: DataSource | None = None) -> TrainConfig:
    """``cfg`` with the denoiser's data-determined fields (latent channels and size, text width)
    filled in, and checked against every phase's latent size."""
    channels, height, _ = meta["latent_shape"]
    denoiser = denoiser_for(cfg).with_data(channels, height, meta["text_shape"][-1])
    for i, phase in enumerate(cfg.phases):
        size, _ = _phase_latent_shape(phase, source or DataSource())
        if size != height:
            denoiser.check_latent_size(size, f"latent side of train.phases[{i}]")
        if denoiser.masks_patches:
            field_path = f"train.phases[{i}].masking_ratio" if phase.masking_ratio is not None else "train.masking.ratio"
            check_kept_tokens(denoiser.num_tokens(size), cfg.masking_ratio_of(i),
                              f"{size}x{size} latents of train.phases[{i}]", field_path)
    return replace(cfg, **{denoiser.config_field: denoiser.cfg})


def resolve_unet_config(cfg: UNetConfig, meta: dict[str, Any]) -> UNetConfig:
    """Fill in the U-Net's data-determined fields (latent channels and size, text width) and check the rest."""
    channels, height, _ = meta["latent_shape"]
    return denoiser_for(TrainConfig(unet=cfg)).with_data(channels, height, meta["text_shape"][-1]).cfg


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device: cuda asked for but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train(cfg: RunConfig, run_dir: str | Path, resume: str = "auto", progress: bool = True,
          world: World | None = None, on_checkpoint: Callable[[Path, int], None] | None = None,
          source: DataSource | None = None, stop_file: str | Path | None = None,
          evaluator: Callable[[Any, Path], dict[str, Any] | None] | None = None, lock: str = "") -> dict[str, Any]:
    """Run (or resume) the training of ``cfg`` in ``run_dir``; returns the trainer's summary
    (``interrupted``: the signal that stopped it with a checkpoint, see ``latentforge.interrupt``).
    ``world``: from :func:`latentforge.distributed.env.init_world` (None = a single process);
    ``on_checkpoint(path, step)``: called on every rank after each complete checkpoint;
    ``source``: where batches come from (None = precomputed latent shards);
    ``stop_file``: a path whose appearance stops the run like a signal (launchers whose workers
    cannot install signal handlers);
    ``evaluator(trainer, checkpoint)``: the evaluation of ``train.eval.every_steps`` in place of the
    recipe's ``eval`` section (returns ``{"rows": [{"guidance_scale": ..., metric: value}]}``);
    ``lock``: the command's name (e.g. "latentforge train"): rank 0 holds ``run_dir``'s lock
    (:func:`latentforge.storage.directory_lock`) from when it first writes there, so a second run in
    the directory stops in one line; a refused config leaves the directory untouched."""
    # Signals received while the run is set up are held until the first step's check.
    with StopOnSignal(cfg.train.interrupt, stop_file=stop_file, what="train") as stop, \
            lock_at_first_write(lock) as take_lock:
        return _train(cfg, run_dir, resume, progress, world, on_checkpoint, source, stop, evaluator, take_lock)


def _train(cfg: RunConfig, run_dir: str | Path, resume: str, progress: bool, world: World | None,
           on_checkpoint: Callable[[Path, int], None] | None, source: DataSource | None,
           stop: StopOnSignal, evaluator: Callable[[Any, Path], dict[str, Any] | None] | None = None,
           take_lock: Callable[[Path], None] = lambda run: None) -> dict[str, Any]:
    world = world or World()
    source = source or DataSource()
    run = Path(run_dir)
    tcfg = cfg.train
    meta = latent_meta(tcfg, source)
    strategy = resolve_strategy(tcfg.parallel, world.world_size)
    if strategy == "fsdp" and tcfg.sampling.prompts and tcfg.sampling.every_steps % tcfg.checkpoint.every_steps:
        raise ConfigError(f"train.sampling.every_steps: {tcfg.sampling.every_steps} is not a multiple of "
                          f"train.checkpoint.every_steps={tcfg.checkpoint.every_steps}: under FSDP the grids are "
                          "drawn from the consolidated weights of a checkpoint")
    if tcfg.lora is not None and not tcfg.init_from:  # FSDP2 and LoRA: refused by TrainConfig.validate
        raise ConfigError("train.lora: LoRA adapts existing weights; set train.init_from to a diffusers pipeline "
                          "directory (latentforge finetune --from DIR)")
    base = None
    if tcfg.init_from:
        base = finetune.open_base(tcfg.init_from)
        finetune.check_recipe_matches_base(base, tcfg)
        finetune.check_data_matches_base(base, meta)
        _note_resolution(base, meta, tcfg, world)
        tcfg = replace(tcfg, noise=finetune.base_noise_config(base, tcfg.noise))
    else:
        tcfg = resolve_model_config(tcfg, meta, source)
    device = pick_device(tcfg.device)
    if tcfg.micro_batch_size == "auto":
        tcfg = resolve_auto_micro_batch(tcfg, [_phase_latent_shape(p, source) for p in tcfg.phases], device,
                                        world.world_size, unet=base.model_config if base else None)
    phase_batches(tcfg, world.world_size)  # batch sizes fail here, before the run directory is touched
    eval_fn = evaluator if tcfg.eval.every_steps else None
    val_set, problems = None, []
    try:
        if tcfg.eval.every_steps and evaluator is None:  # its inputs fail here too, not after the first every_steps steps
            eval_fn = training_evaluator(cfg.eval, tcfg.eval, run, world)
    except ConfigError as e:
        problems.append(f"{e} (or train.eval.every_steps=0: no evaluation during training)")
    try:
        # The held-out latents of the validation loss: read (and checked against the training data) before the run starts.
        val_set = load_validation_set(tcfg.val, cfg.data, meta) if tcfg.val.every_steps else None
    except ConfigError as e:
        problems.append(str(e))
    if problems:  # both at once: a recipe made for other data (the demo's) usually needs both turned off
        raise ConfigError("\n".join(problems))
    resume_from = ckpt.resolve_resume(run, resume)
    if world.is_main:
        keep_earlier = _check_same_run(run, replace(cfg, train=tcfg), resume_from)
        run.mkdir(parents=True, exist_ok=True)
        take_lock(run)  # at the first write to the run directory
        keep_earlier()
        save_config(replace(cfg, train=tcfg), run / TRAIN_CONFIG)
        (run / DATA_META).write_text(json.dumps(meta, indent=1))

    torch.manual_seed(tcfg.seed)  # also seeds the LoRA adapters' initialisation
    # Under CPU offload the model stays in host memory: fully_shard moves one block at a time to the
    # device and its shards back, so the whole fp32 model is never on the device.
    init_device = torch.device("cpu") if tcfg.parallel.cpu_offload else device
    if base is not None:
        model = finetune.build_finetune_model(base, tcfg.lora, getattr(torch, tcfg.frozen_dtype)).to(init_device)
    else:
        model = denoiser_for(tcfg).build().to(init_device)
    model.train()
    # Wrappers (DDP) and sharding (FSDP2) apply to train_model; `model` stays the plain handle
    # for the optimizer, the EMA and state dicts.
    train_model, no_sync = parallelize(model, tcfg.parallel, world, device)
    world = replace(world, no_sync=no_sync)

    def make_loader(phase: int, micro: int):
        loader_cfg = replace(cfg.data, datasets=tcfg.phases[phase].datasets)
        if is_bucketed(loader_cfg.datasets[0].path):
            _, accum, _ = phase_batches(tcfg, world.world_size)[phase]
            if cfg.data.bucket_leftovers == "small_batch" and accum > 1:
                raise ConfigError("data.bucket_leftovers: small_batch cannot be split into gradient accumulation "
                                  "steps: set the global batch to the micro batch, or use carry")
            return build_bucket_loader(loader_cfg, micro, rank=world.rank, world_size=world.world_size)
        return source.build_loader(loader_cfg, micro, rank=world.rank, world_size=world.world_size)

    # The diffusers class, not type(model): FSDP2 has swapped in a subclass (FSDP<class>) by now.
    model_config = {**dict(model.config), "_class_name": denoiser_of(model).model_class_name}
    sample_fn = training_sampler(tcfg, meta, run) if tcfg.sampling.prompts and world.is_main else None
    if sample_fn is not None and strategy == "fsdp":
        sample_fn = _from_consolidated(sample_fn, model_config, device)
    flops, peak = _flops_and_peak(tcfg, device, model_config, source)
    trainer = Trainer(tcfg, model, make_loader, run, meta, world=world, device=device, sample_fn=sample_fn,
                      progress=progress, flops_per_image=flops, peak_flops=peak, on_checkpoint=on_checkpoint,
                      train_model=train_model, eval_fn=eval_fn, stop=stop, val_set=val_set)
    if resume_from is not None and world.is_main:  # also with --quiet: where a requeued job went on from
        print(f"resuming from {resume_from}", flush=True)
    return trainer.fit(resume_from)


def _note_resolution(base: Any, meta: dict[str, Any], cfg: TrainConfig, world: World) -> None:
    """A fine-tune whose phases leave the resolution at 0 trains at the latents' resolution: say
    so when it is not the pipeline's own (SD fine-tunes at other sizes too, so it is not refused)."""
    native = base.model_config.get("sample_size", 0) * meta["vae"].get("downsample_factor", 0)
    if world.is_main and meta.get("resolution") != native and not all(p.resolution for p in cfg.phases):
        print(f"finetune: training at the latents' {meta.get('resolution')} px; {base.path} was made for "
              f"{native} px", flush=True)


def _from_consolidated(sample_fn: Callable[[Any, int], None], unet_config: dict[str, Any], device: torch.device
                       ) -> Callable[[Any, int], None]:
    """Rank 0 alone cannot run a sharded model (every forward pass all-gathers from all ranks):
    draw the grid with a plain model holding the EMA (or model) weights of the checkpoint just
    written at this step (one more model copy in rank 0's memory while sampling)."""

    def sample(trainer: Any, step: int) -> None:
        path = ckpt.find_latest(trainer.run_dir)
        c = ckpt.load_checkpoint(path, verify=False)
        if c.step != step:
            raise RuntimeError(f"sampling at step {step} needs its checkpoint, the newest is {path}")
        plain = denoiser_from_config(unet_config).build().to(device)
        plain.load_state_dict(c.tensors["ema" if "ema" in c.tensors else "model"])
        view = SimpleNamespace(model=plain, ema=None, device=device)
        sample_fn(view, step)

    return sample


def _check_same_run(run: Path, cfg: RunConfig, resume_from: Path | None) -> Callable[[], None]:
    """Resuming with a changed model or objective would silently train something else: refuse. A run
    that starts in a new directory from another run's checkpoint (``--resume PATH``) is checked
    against that run's settings (``PATH/../../train_config.yaml``), where they were kept. Returns
    what to do once the run directory is held: keep the earlier settings beside the changed ones."""
    if resume_from is None:
        return lambda: None
    old = run / TRAIN_CONFIG
    if not old.exists():
        old = resume_from.parent.parent / TRAIN_CONFIG
        if not old.exists():
            return lambda: None
    own = old.parent == run  # else the settings of the run that wrote the checkpoint
    started = "the run was started with" if own else f"the run of {resume_from} was trained with"
    shown_old = TRAIN_CONFIG if own else str(old)
    from latentforge.config import load_config, to_dict

    saved = load_config(RunConfig, old)
    before = to_dict(saved.train)
    now = to_dict(cfg.train)
    fixed = ("model", "unet", "dit", "noise", "seed", "sample_posterior", "offset_noise", "min_snr_gamma",
             "min_snr_floor", "init_from", "lora")
    for key in fixed:
        b, n = before.get(key), now.get(key)
        if key in ("unet", "dit"):  # data-filled fields were None in the user's config
            n = {k: (v if v is not None else b.get(k)) for k, v in n.items()}
        if b != n:
            raise UserError(f"{run}: resuming with a different train.{key} than {started} "
                            f"({shown_old}); " + ("use a new run directory or restore the setting" if own
                                                   else "restore the setting, or train without --resume"))
    try:
        done = int(json.loads((resume_from / ckpt.META).read_text()).get("phase", 0))  # phases finished
    except (OSError, ValueError):
        done = 0
    for i, (b, n) in enumerate(zip(before.get("phases", [])[:done], now.get("phases", []))):
        if (b.get("steps"), b.get("samples")) != (n.get("steps"), n.get("samples")):
            name = f" ({b['name']})" if b.get("name") else ""
            raise UserError(f"{run}: phase {i}{name} finished at its {b.get('steps') or b.get('samples')} "
                            f"{'steps' if b.get('steps') else 'samples'}"
                            + ("" if own else f" in the run of {resume_from}")
                            + "; a finished phase does not grow: add a phase to train.phases to train on"
                            + (", or use a new run directory" if own else ""))
    changes = _changes({"train": {k: v for k, v in before.items() if k not in fixed},
                        "data": to_dict(saved.data)},
                       {"train": {k: v for k, v in now.items() if k not in fixed}, "data": to_dict(cfg.data)})
    if not changes:
        return lambda: None
    earlier = old.read_bytes()

    def keep() -> None:  # the settings the earlier steps ran with stay on record next to the ones that replace them
        kept = run / f"{Path(TRAIN_CONFIG).stem}.until-{resume_from.name}{Path(TRAIN_CONFIG).suffix}"
        kept.write_bytes(earlier)
        shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
        print(f"train: resuming with changed settings ({shown}); the earlier ones are kept in {kept.name}", flush=True)
    return keep


def _changes(before: Any, now: Any, key: str = "") -> list[str]:
    """``"train.optim.lr: 0.002 -> 0.0001"`` for each leaf that differs; a list that grew or shrank
    also says ``"train.phases: 1 -> 2 entries"``."""
    if isinstance(before, dict) and isinstance(now, dict):
        return [c for k in sorted(set(before) | set(now))
                for c in _changes(before.get(k), now.get(k), f"{key}.{k}" if key else k)]
    if isinstance(before, list) and isinstance(now, list):
        common = [c for i, (b, n) in enumerate(zip(before, now)) for c in _changes(b, n, f"{key}.{i}")]
        return common + ([f"{key}: {len(before)} -> {len(now)} entries"] if len(before) != len(now) else [])

    def short(value: Any) -> str:
        text = str(value)
        return text if len(text) <= 60 else text[:57] + "..."

    return [] if before == now else [f"{key}: {short(before)} -> {short(now)}"]


def _phase_latent_shape(phase, source: DataSource) -> tuple[int, int]:
    """(latent side, caption tokens) of a phase's first dataset; for aspect-ratio buckets, the
    square latent of the same area."""
    path = phase.datasets[0].path
    if is_bucketed(path):
        index, (_, size, _) = bucketed_index(path)
    else:
        index = source.read_index(path)
        size = parse_ndarray(index.columns["latent_mean"])[1][1]
    return size, parse_ndarray(index.columns["text_hidden"])[1][0]


def _flops_and_peak(cfg: TrainConfig, device: torch.device, model_config: dict[str, Any],
                    source: DataSource) -> tuple[list[float], float]:
    """Model FLOPs per training image of each phase (its latent size) and the device's peak."""
    from latentforge.plan.flops import device_peak_flops, train_flops_per_image

    flops = []
    for i, phase in enumerate(cfg.phases):
        size, text_len = _phase_latent_shape(phase, source)
        flops.append(float(train_flops_per_image(model_config, size, text_len, cfg.masking_ratio_of(i),
                                                 cfg.masking.mixer_blocks)))
    precision = "bf16" if cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda") else "fp32"
    peak, _ = device_peak_flops(device, precision)
    return flops, peak
