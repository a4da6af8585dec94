"""Every problem that a config's ``validate()`` can report names the exact YAML path of its field.

The checks are enumerated from the source: every ``raise ConfigError(...)`` and ``problems.add(...)``
in a ``validate()`` method of src/latentforge (and in the helpers that ``validate()`` calls) is a
site. The table below holds, for each site and each field that a site checks, a recipe and the one
value that breaks that field alone. Each case writes that value into a YAML recipe at the dotted
path, loads the recipe, and requires exactly one problem whose path is that dotted path and which
resolves to a field of the resolved recipe. The sites the cases reached must be all the sites: a
new check without a case here fails ``test_every_check_has_a_case``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import latentforge
from latentforge.cli import main
from latentforge.config import apply_overrides, from_dict, load_yaml, to_dict
from latentforge.distributed.ray_cluster import RayConfig
from latentforge.errors import ConfigError, Problem
from latentforge.models.dit import DiTConfig
from latentforge.models.unet import UNetConfig
from latentforge.train.memory import MemoryConfig
from latentforge.recipe import Recipe, load_recipe, resolve_recipe_path

SRC = Path(latentforge.__file__).resolve().parent
# Module-level functions that validate() methods call and that raise ConfigError themselves.
HELPERS = {"_check_names", "parse_combo", "lora_parallel_problems", "check_patch_size"}
TINY, LORA = "tiny-cpu", "finetune-lora-8gb"
FSDP = ["train.parallel.strategy=fsdp"]
# min-SNR off, and with it the recipe's floor under its weights (tiny-cpu's is 0.05 since run 24), and the
# DDPM samplers' timestep spacing back to its default (tiny-cpu's is trailing since run 25)
FLOW = ("train.noise.prediction_type=flow_matching", "train.min_snr_gamma=0", "train.min_snr_floor=0",
        "train.noise.timestep_spacing=leading")


@dataclass(frozen=True)
class Case:
    path: str  # the dotted YAML path the message must name ([i] for list items)
    value: str  # YAML text of the bad value
    says: str  # a fragment of the message
    extra: tuple[str, ...] = ()  # overrides that set the scene (valid on their own, unless `also`)
    recipe: str = TINY
    also: tuple[str, ...] = ()  # paths of the problems that the scene itself has

    def __str__(self) -> str:
        return f"{self.path}={self.value}"


def c(path: str, value: str, says: str, *extra: str, recipe: str = TINY, also: tuple[str, ...] = ()) -> Case:
    return Case(path, value, says, tuple(extra), recipe, also)


CASES = [
    # synth
    c("synth.num", "0", "must be at least 1"),
    c("synth.num_heldout", "-1", "must be 0 or more"),
    c("synth.seed", "-1", "must be 0 or more"),
    c("synth.image_size", "8", "at least 16 px"),
    c("synth.partial_captions", "1.5", "must be a share in [0, 1]"),
    c("synth.extra_templates", "1.5", "must be a share in [0, 1]"),
    c("synth.extra_templates", "0.6", "together at most 1", "synth.partial_captions=0.6"),
    c("synth.shapes", "[]", "empty; list at least one of"),
    c("synth.sizes", "[huge]", "unknown 'huge'"),
    c("synth.positions", "[top, top]", "'top' is listed twice"),
    c("synth.colors", "[]", "empty"),
    c("synth.heldout", "[red blob]", "is not '<colour> <shape>'"),
    c("synth.heldout", "[green circle]", "uses colour 'green', which is not in colors",
      "synth.colors=[red, yellow]", "synth.heldout=[]", "synth.num_heldout=0"),
    c("synth.heldout", "[red star]", "uses shape 'star', which is not in shapes",
      "synth.shapes=[circle, square]", "synth.heldout=[]", "synth.num_heldout=0"),
    c("synth.heldout", "[red star, red star]", "is listed twice"),
    c("synth.heldout", "[red circle, red square]", "holds out every shape in red",
      "synth.shapes=[circle, square]", "synth.colors=[red, yellow]", "synth.heldout=[]", "synth.num_heldout=0"),
    c("synth.heldout", "[red circle, yellow circle]", "holds out circle in every colour",
      "synth.shapes=[circle, square]", "synth.colors=[red, yellow]", "synth.heldout=[]", "synth.num_heldout=0"),
    c("synth.num_heldout", "5", "heldout is empty; set num_heldout=0", "synth.heldout=[]", "synth.num_heldout=0"),
    # ingest
    c("ingest.num_workers", "-1", "0 = one per CPU core"),
    c("ingest.row_group_size", "0", "must be >= 1"),
    c("ingest.filters.min_side", "-1", "must be >= 0"),
    c("ingest.filters.max_aspect", "0.5", "must be >= 1"),
    c("ingest.filters.min_caption_chars", "-1", "must be >= 0"),
    c("ingest.filters.max_caption_chars", "-1", "must be >= 0"),
    c("ingest.filters.max_caption_chars", "5", "is below min_caption_chars 10", "ingest.filters.min_caption_chars=10"),
    c("ingest.image.resolution", "4", "must be >= 8"),
    c("ingest.image.bucket_step", "12", "positive multiple of 8"),
    c("ingest.image.resolution", "96", "not a multiple of bucket_step 64",
      "ingest.image.crop=buckets", "ingest.image.bucket_step=64", "ingest.image.resolution=64"),
    c("ingest.image.quality", "0", "must be in 1..100"),
    c("ingest.image.bucket_max_aspect", "0.5", "must be >= 1"),
    c("ingest.source.image_column", "''", "empty; give a column name"),
    c("ingest.source.caption_column", "''", "empty; give a column name"),
    c("ingest.source.folder_chunk", "0", "must be >= 1"),
    c("ingest.source.parquet_unit_rows", "-1", "must be >= 0"),
    c("ingest.source.caption_ext", ".png", "not a plain extension"),
    # vae
    c("vae.steps", "-1", "must be >= 0"),
    c("vae.max_seconds", "-1", "must be >= 0"),
    c("vae.steps", "0", "set steps or max_seconds"),
    c("vae.batch_size", "0", "must be >= 1"),
    c("vae.lr", "0", "must be > 0"),
    c("vae.color_weight", "-1", "must be >= 0"),
    c("vae.decoder_noise", "-0.5", "must be >= 0"),
    c("vae.latent_scale", "0", "must be > 0"),
    c("vae.l1_weight", "0", "at least one reconstruction term must be on", "vae.mse_weight=0"),
    c("vae.checkpoint_every_steps", "0", "must be >= 1"),
    c("vae.interrupt.grace_seconds", "-1", "must be >= 0"),
    c("vae.data.num_workers", "-1", "must be >= 0"),
    c("vae.model.block_out_channels", "[]", "at least one positive channel count"),
    c("vae.model.norm_num_groups", "5", "must divide every entry"),
    c("vae.model.layers_per_block", "0", "must be at least 1"),
    c("vae.model.latent_channels", "0", "must be at least 1"),
    c("vae.model.sample_size", "33", "positive multiple of the downsample factor 2"),
    c("vae.model.scaling_factor", "0", "must be positive"),
    # encode
    c("encode.max_length", "0", "must be at least 1"),
    c("encode.batch_size", "0", "must be at least 1"),
    c("encode.text_cache_mb", "-1", "must be >= 0"),
    c("encode.interrupt.check_every_steps", "0", "must be >= 1"),
    # loader
    c("loader.caption_dropout", "1.0", "must be in [0, 1)"),
    c("loader.shuffle_window_shards", "0", "must be >= 1"),
    c("loader.mix_block", "1", "less than the number of datasets (2)", "loader.datasets=[{path: a}, {path: b}]"),
    c("loader.num_workers", "-1", "must be >= 0"),
    c("loader.prefetch_factor", "0", "must be >= 1"),
    c("loader.cache_limit_gb", "0", "must be > 0"),
    c("loader.datasets[0].path", "''", "required", "loader.datasets=[{path: a}]"),
    c("loader.datasets[0].weight", "0", "must be > 0", "loader.datasets=[{path: a}]"),
    # train
    c("train.micro_batch_size", "auto", "set global_batch_size"),
    c("train.micro_batch_size", "0", "must be >= 1"),
    c("train.global_batch_size", "-1", "must be >= 0"),
    c("train.log_every", "0", "must be >= 1"),
    c("train.min_snr_gamma", "-1", "must be >= 0"),
    c("train.min_snr_floor", "1.5", "must be in [0, 1]"),
    c("train.min_snr_floor", "0.2", "min_snr_gamma is 0", "train.min_snr_gamma=0", "train.min_snr_floor=0"),
    c("train.timestep_importance", "1.5", "must be in [0, 1]"),
    c("train.timestep_importance", "1", "min_snr_gamma is 0", "train.min_snr_gamma=0", "train.min_snr_floor=0"),
    c("train.offset_noise", "-1", "must be >= 0"),
    c("train.text_noise", "-0.1", "must be in [0, 1]"),
    c("train.max_skipped_steps", "-1", "must be >= 0"),
    c("train.max_seconds", "-1", "must be >= 0"),
    c("train.optim.name", "adamw8bit", "does not run on FSDP2's sharded", *FSDP),
    c("train.optim.name", "muon", "orthogonalises whole matrices and FSDP2 shards them", *FSDP),
    c("train.frozen_dtype", "bfloat16", "train.lora is not set"),
    c("train.frozen_dtype", "bfloat16", "set train.precision: bf16", "train.precision=fp32",
      "train.frozen_dtype=float32", recipe=LORA),
    c("train.parallel.strategy", "fsdp", "fsdp does not shard LoRA runs", recipe=LORA),
    # These three conflicts exist only under fsdp, which a LoRA run is refused on its own: two problems.
    c("train.parallel.mixed_precision", "bf16", "which a LoRA run does not use", *FSDP, recipe=LORA,
      also=("train.parallel.strategy",)),
    c("train.parallel.cpu_offload", "true", "which a LoRA run does not use", *FSDP, recipe=LORA,
      also=("train.parallel.strategy",)),
    c("train.parallel.reshard_after_forward", "true", "which a LoRA run does not use", *FSDP, recipe=LORA,
      also=("train.parallel.strategy",)),
    c("train.parallel.mixed_precision", "bf16", "needs parallel.strategy=fsdp"),
    c("train.parallel.cpu_offload", "true", "needs parallel.strategy=fsdp"),
    c("train.parallel.reshard_after_forward", "true", "only applies to parallel.strategy=fsdp"),
    c("train.phases[0].steps", "-1", "must be >= 0"),
    c("train.phases[0].samples", "-1", "must be >= 0"),
    c("train.phases[0].micro_batch_size", "-1", "must be >= 0"),
    c("train.phases[0].global_batch_size", "-1", "must be >= 0"),
    c("train.phases[0].steps", "0", "set exactly one of steps and samples"),
    c("train.phases[0].resolution", "-1", "must be >= 0"),
    c("train.phases[0].lr", "-1", "must be >= 0"),
    c("train.phases[0].min_snr_floor", "1.5", "must be in [0, 1]"),
    c("train.phases[0].min_snr_floor", "0.2", "min_snr_gamma is 0", "train.min_snr_gamma=0",
      "train.min_snr_floor=0"),
    c("train.phases[0].datasets[0].weight", "0", "must be > 0", "train.phases.0.datasets=[{path: a}]"),
    c("train.checkpoint.every_steps", "0", "must be >= 1"),
    c("train.checkpoint.keep_last", "0", "must be >= 1"),
    c("train.checkpoint.keep_every", "-1", "must be >= 0"),
    c("train.eval.every_steps", "-1", "must be >= 0"),
    c("train.eval.num_images", "-1", "must be >= 0"),
    c("train.eval.price_per_gpu_hour", "-1", "must be >= 0"),
    c("train.val.every_steps", "-1", "must be >= 0"),
    c("train.val.num_samples", "-1", "must be >= 0"),
    c("train.val.num_timesteps", "0", "must be >= 1"),
    c("train.val.batch_size", "0", "must be >= 1"),
    c("train.interrupt.extra_signal", "SIGNOPE", "not a signal that can be caught"),
    c("train.interrupt.grace_seconds", "-1", "must be >= 0"),
    c("train.interrupt.check_every_steps", "0", "must be >= 1"),
    c("train.ema.decay", "1.0", "must be in (0, 1)"),
    c("train.ema.start_step", "-1", "must be >= 0"),
    c("train.optim.lr", "0", "must be > 0"),
    c("train.optim.betas", "[0.9, 1.0]", "beta2 must be in [0, 1)"),
    c("train.optim.weight_decay", "-1", "must be >= 0"),
    c("train.optim.eps", "0", "must be > 0"),
    c("train.optim.grad_clip", "-1", "must be >= 0"),
    c("train.optim.warmup_steps", "-1", "must be >= 0"),
    c("train.optim.min_lr_ratio", "2", "must be in [0, 1]"),
    c("train.optim.muon_momentum", "1.0", "muon_momentum: must be in [0, 1)"),
    c("train.optim.muon_ns_steps", "0", "muon_ns_steps: must be >= 1"),
    c("train.lora.rank", "0", "must be >= 1", recipe=LORA),
    c("train.lora.alpha", "-1", "must be >= 0", recipe=LORA),
    c("train.lora.target_modules", "[]", "empty; name the modules", recipe=LORA),
    c("train.lora.dropout", "1.0", "must be in [0, 1)", recipe=LORA),
    c("train.noise.num_train_timesteps", "1", "must be at least 2"),
    c("train.noise.beta_start", "0.5", "need 0 < beta_start < beta_end < 1"),
    c("train.noise.steps_offset", "-1", "must be >= 0"),
    c("train.noise.prediction_type", "epsilon", "needs v_prediction", "train.noise.rescale_zero_terminal_snr=true",
      "train.noise.timestep_spacing=trailing"),
    c("train.noise.timestep_spacing", "leading", "needs trailing", "train.noise.rescale_zero_terminal_snr=true",
      "train.noise.timestep_spacing=trailing"),
    # flow matching (the demo recipe has min-SNR 5, which flow matching refuses)
    c("train.noise.flow_logit_std", "0", "must be positive", *FLOW),
    c("train.noise.flow_shift", "0", "must be positive", *FLOW),
    c("train.noise.flow_shift_base_size", "-1", "must be >= 0", *FLOW),
    c("train.noise.rescale_zero_terminal_snr", "true", "ends at pure noise", *FLOW),
    c("train.noise.beta_start", "0.001", "not used by flow_matching", *FLOW),
    c("train.noise.flow_shift", "2", "only used with prediction_type flow_matching"),
    c("train.min_snr_gamma", "3", "not used with flow_matching", *FLOW),
    c("train.offset_noise", "0.1", "already ends at pure noise", *FLOW),
    c("train.timestep_importance", "0.5", "draws sigma from its own density", *FLOW),
    c("train.sampling.sampler", "ddpm", "no flow-matching form", *FLOW),
    c("train.unet.layers_per_block", "null", "required when preset is 'custom'", "train.unet.preset=custom",
      "train.unet.layers_per_block=1", "train.unet.cross_attention_dim=16"),
    c("train.unet.block_out_channels", "[]", "needs at least one level"),
    c("train.unet.layers_per_block", "0", "must be a positive integer"),
    c("train.unet.attention_head_dim", "[1, 2]", "has 2 entries but block_out_channels has 3 levels"),
    c("train.unet.down_block_types", "[DownBlock2D, Nope, CrossAttnDownBlock2D]", "unknown block 'Nope'"),
    c("train.unet.block_out_channels", "[16, 32, 60]", "not a positive multiple of norm_num_groups 8"),
    c("train.unet.attention_head_dim", "[1, 2, 3]", "3 heads do not divide 64 channels"),
    c("train.unet.transformer_layers_per_block", "0", "must be positive"),
    c("train.unet.addition_embed_type_num_heads", "8", "set without addition_embed_type"),
    c("train.unet.addition_embed_type_num_heads", "5", "5 heads do not divide cross_attention_dim 384",
      "train.unet.addition_embed_type=text"),
    c("train.dit.num_layers", "0", "must be a positive integer", "train.model=dit"),
    c("train.dit.patch_size", "3", "does not divide the sample_size 16", "train.model=dit"),
    c("train.masking.ratio", "1", "must be >= 0 and < 1", "train.model=dit"),
    c("train.masking.ratio", "0.5", "train.model is unet: set train.model: dit"),
    c("train.masking.mixer_blocks", "-1", "must be >= 0"),
    c("train.masking.mixer_blocks", "2", "of the transformer's 2 blocks leaves none", "train.model=dit"),
    c("train.phases[0].masking_ratio", "-0.5", "must be >= 0 and < 1", "train.model=dit"),
    c("train.phases[0].masking_ratio", "0.75", "train.model is unet: set train.model: dit"),
    # demo
    c("demo.prompts_per_combo", "0", "must be at least 1"),
    c("demo.new_wording_per_combo", "-1", "must be 0"),
    c("demo.batch_size", "0", "must be at least 1"),
    c("demo.curve_per_combo", "-1", "must be 0 (no curve) or more"),
    c("demo.num_steps", "0", "must be at least 1"),
    c("demo.guidance_scale", "-1", "must be a number above 0"),
    c("demo.seed", "-1", "must be 0 or more"),
    c("demo.judge.lr", "0", "must be > 0"),
    c("demo.judge.noise_std", "-1", "must be >= 0"),
    c("demo.judge.seed", "-1", "must be >= 0"),
    c("demo.wordings", "[caption, nope]", "unknown wording 'nope'"),
    c("demo.wordings", "[plain]", "must include 'caption'"),
    c("demo.judge.floor", "1.0", "must be in [0, 1)"),
    c("demo.judge.blur_prob", "2", "must be in [0, 1]"),
    c("demo.judge.resample_prob", "-1", "must be in [0, 1]"),
    c("demo.judge.halo_prob", "1.5", "must be in [0, 1]"),
    c("demo.judge.smear_prob", "-0.1", "must be in [0, 1]"),
    c("demo.judge.epochs", "0", "must be >= 1"),
    c("demo.judge.batch_size", "0", "must be >= 1"),
    c("demo.judge.width", "0", "must be >= 1"),
    c("demo.judge.levels", "0", "must be >= 1"),
    c("demo.judge.pool", "mean", "must be one of max, max+mean"),
    c("demo.judge.num_nonshapes", "-1", "must be >= 0"),
    c("demo.judge.num_resized", "-1", "must be >= 0"),
    c("demo.judge.resized_widths", "[0.5,0.3]", "must be [low, high]"),
    c("demo.judge.resized_widths", "[0.3]", "must be [low, high]"),
    c("demo.judge.extra_nonshapes", "[sparkles]", "unknown kind 'sparkles'"),
    c("demo.judge.kind_shares", "{hexagons: 0}", "'hexagons' is not a non-shape kind drawn"),
    c("demo.judge.kind_shares", "{hexagon: -1}", "the share of 'hexagon' must be a number >= 0"),
    c("demo.judge.circle_max_corners", "0", "must be > 0 (px)"),
    c("demo.judge.circle_max_edge", "-1", "must be > 0 (px)"),
    c("demo.judge.circle_min_ratio", "1.5", "must be in (0, 1]"),
    c("demo.judge.star_min_points", "1.2", "must be in (0, 1) (an amplitude over the mean radius)"),
    c("demo.judge.star_max_edge", "0", "must be > 0 (px)"),
    c("demo.judge.ensemble", "0", "must be >= 1"),
    c("demo.judge.threads", "0", "must be >= 1"),
    # eval
    c("eval.guidance_scales", "[]", "empty; give at least one scale"),
    c("eval.guidance_scales", "[-1]", "must be >= 0"),
    c("eval.guidance_scales", "[1, 1]", "duplicates"),
    c("eval.num_steps", "0", "must be >= 1"),
    c("eval.batch_size", "0", "must be >= 1"),
    c("eval.kid_subsets", "0", "must be >= 1"),
    c("eval.kid_subset_size", "1", "must be >= 2"),
    c("eval.num_images", "-1", "must be >= 0"),
    c("eval.max_reference", "-1", "must be >= 0"),
    c("eval.inception_feature", "100", "must be one of 64, 192, 768, 2048"),
    c("eval.device", "tpu", "unknown 'tpu'"),
    # plan
    c("plan.gpu", "nope", "unknown 'nope'; choose one of"),
    c("plan.gpus", "[0]", "every GPU count must be >= 1"),
    c("plan.price_per_gpu_hour", "-1", "must be >= 0"),
    c("plan.img_per_s_per_gpu", "{'256': 0}", "throughputs must be > 0"),
    c("plan.scaling_efficiency", "{'8': 2}", "efficiencies must be in (0, 1]"),
    c("plan.goodput", "0", "must be in (0, 1]"),
    c("plan.num_images", "-1", "must be >= 0"),
    c("plan.encode_img_per_s_per_gpu", "0", "must be > 0"),
    c("plan.precision", "fp8", "one of bf16, fp16, tf32, fp32"),
    c("plan.mfu", "1.5", "must be in (0, 1] (or 0 = use img_per_s_per_gpu)"),
]

# Configs that no recipe holds: built from command-line flags. Their paths are their own field names.
FLAG_CASES = [
    (MemoryConfig, "latent_size", 0, {}, "must be >= 1"),
    (MemoryConfig, "text_len", 0, {}, "must be >= 1"),
    (MemoryConfig, "micro_batch_size", 0, {}, "must be >= 1"),
    (MemoryConfig, "world_size", 0, {}, "must be >= 1"),
    (MemoryConfig, "cpu_offload", True, {}, "is FSDP2's CPU offload"),
    (MemoryConfig, "optimizer", "adamw8bit", {"parallel": "fsdp-full"}, "does not run on FSDP2"),
    (MemoryConfig, "optimizer", "muon", {"parallel": "fsdp-grad-op"}, "muon does not run on FSDP2"),
    (MemoryConfig, "lora_rank", -1, {}, "must be >= 0"),
    (MemoryConfig, "parallel", "fsdp-full", {"lora_rank": 4}, "LoRA runs are not sharded"),
    (MemoryConfig, "precision", "bf16-weights", {"lora_rank": 4}, "which a LoRA run does not use"),
    (MemoryConfig, "frozen_dtype", "bfloat16", {}, "set lora_rank or use float32"),
    (RayConfig, "num_workers", 0, {}, "must be >= 1"),
    (RayConfig, "gpus_per_worker", -1.0, {}, "must be >= 0"),
    (RayConfig, "cpus_per_worker", 0.0, {}, "must be > 0"),
    (RayConfig, "max_failures", -2, {}, "must be >= 0"),
    (RayConfig, "object_store_gb", 0.0, {}, "must be >= 0.1"),
]

# Checks that no YAML value reaches (the field's type refuses the value first), exercised on a
# config built in code: (config, constructor arguments, field, message fragment).
DIRECT_CASES = [
    (UNetConfig, {"preset": "nope"}, "preset", "unknown 'nope'"),
    (DiTConfig, {"preset": "nope"}, "preset", "unknown 'nope'"),
]



def _override_key(path: str) -> str:
    return re.sub(r"\[(\d+)\]", r".\1", path)


def _follow(data, path: str):
    """The value at a dotted YAML path with [i] list items; KeyError if the path does not exist."""
    node = data
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            node = node[int(part[1:-1])]
        else:
            if not isinstance(node, dict) or part not in node:
                raise KeyError(path)
            node = node[part]
    return node


def _only_problem(e: ConfigError, also: tuple[str, ...] = ()) -> Problem:
    """The one problem of the broken field (besides those at the paths ``also``)."""
    mine = [p for p in e.problems if p.text.split(": ", 1)[0] not in also]
    assert len(mine) == 1, f"more than the one broken field reported: {e.problems}"
    assert len(e.problems) == len(mine) + len(also), e.problems
    return mine[0]


def _run_case(case: Case, tmp_path: Path) -> Problem:
    """Write the case's recipe as YAML, load it, and check the problem it gives; returns it."""
    data = apply_overrides(load_yaml(resolve_recipe_path(case.recipe)), list(case.extra))
    try:
        good = from_dict(Recipe, data)  # the scene alone is valid
    except ConfigError as e:
        assert case.also and sorted(p.text.split(": ", 1)[0] for p in e.problems) == sorted(case.also), e
        good = from_dict(Recipe, apply_overrides(data, [f"{_override_key(p)}=auto" for p in case.also]))
    _follow(to_dict(good), case.path)  # the path names a field of the resolved recipe
    bad = apply_overrides(data, [f"{_override_key(case.path)}={case.value}"])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(bad))
    assert _follow(yaml.safe_load(recipe.read_text()), case.path) == yaml.safe_load(case.value)
    with pytest.raises(ConfigError) as e:
        load_recipe(str(recipe))
    problem = _only_problem(e.value, case.also)
    assert problem.text.startswith(f"{case.path}: ") and case.says in problem.text, problem.text
    return problem


def _run_direct_case(cls, kwargs, name, says) -> Problem:
    _follow(to_dict(cls()), name)
    with pytest.raises(ConfigError) as e:
        cls(**kwargs).validate()
    problem = _only_problem(e.value)
    assert problem.text.startswith(f"{name}: ") and says in problem.text, problem.text
    return problem


def _run_flag_case(cls, name, value, scene, says) -> Problem:
    from_dict(cls, scene)
    _follow(to_dict(cls()), name)
    with pytest.raises(ConfigError) as e:
        from_dict(cls, {**scene, name: value})
    problem = _only_problem(e.value)
    assert problem.text.startswith(f"{name}: ") and says in problem.text, problem.text
    return problem


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_problem_names_its_yaml_path(case: Case, tmp_path):
    _run_case(case, tmp_path)


@pytest.mark.parametrize("cls, kwargs, name, says", DIRECT_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_problem_of_a_config_built_in_code_names_its_field(cls, kwargs, name, says):
    _run_direct_case(cls, kwargs, name, says)


@pytest.mark.parametrize("cls, name, value, scene, says", FLAG_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_problem_of_a_flag_config_names_its_field(cls, name, value, scene, says):
    _run_flag_case(cls, name, value, scene, says)


def _check_sites() -> dict[tuple[str, int], str]:
    """(file, first line) -> source of every ConfigError raise / problems.add in a validate() method
    or a helper it calls, with the lines each spans."""
    sites = {}
    for f in sorted(SRC.rglob("*.py")):
        text = f.read_text()
        tree = ast.parse(text)
        functions = [fn for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for fn in cls.body
                     if isinstance(fn, ast.FunctionDef) and fn.name == "validate"]
        functions += [fn for fn in tree.body if isinstance(fn, ast.FunctionDef) and fn.name in HELPERS]
        for fn in functions:
            for node in ast.walk(fn):
                is_raise = (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                            and getattr(node.exc.func, "id", "") == "ConfigError")
                is_add = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                          and node.func.attr == "add" and getattr(node.func.value, "id", "") == "problems")
                if is_raise or is_add:
                    for line in range(node.lineno, node.end_lineno + 1):
                        sites[(str(f), line)] = f"{f.relative_to(SRC)}:{node.lineno}"
    return sites


def test_every_check_has_a_case(tmp_path):
    """Each check site is reached by one of the cases (which also pass, as above)."""
    sites = _check_sites()
    all_sites = set(sites.values())
    assert len(all_sites) > 140  # the enumeration found the checks
    found = [_run_case(case, tmp_path) for case in CASES]
    found += [_run_direct_case(*case) for case in DIRECT_CASES] + [_run_flag_case(*case) for case in FLAG_CASES]
    found_sites = {(str(Path(p.site[0]).resolve()), p.site[1]) for p in found}
    outside = found_sites - sites.keys()
    assert not outside, f"problems from outside the enumerated checks: {outside}"
    reached = {sites[s] for s in found_sites}
    missing = sorted(all_sites - reached)
    assert not missing, f"checks without a case in tests/test_config_paths.py: {missing}"


def test_all_conflicts_of_lora_on_the_fsdp_recipe_at_once(capsys):
    """The issue's report: train.lora added to finetune-8gb took four refused runs. One run now lists
    the four conflicts, each with its fix, one line each, exit code 2, no traceback."""
    code = main(["config", "show", "--recipe", "finetune-8gb", "train.lora={rank: 8}"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    paths = [line.removeprefix("latentforge: error: ").split(": ", 1)[0] for line in lines]
    assert paths == ["train.parallel.strategy", "train.parallel.mixed_precision", "train.parallel.cpu_offload",
                     "train.parallel.reshard_after_forward"], err
    assert all("; " in line.split(": ", 2)[2] for line in lines)  # what is wrong; the fix
    recipe = load_yaml(resolve_recipe_path("finetune-8gb"))
    for path in paths:  # each names a setting the recipe makes
        _follow(recipe, path)
    # Applying the fixes the lines give (use auto; remove the three) leaves a valid LoRA recipe.
    fixed = apply_overrides(recipe, ["train.lora={rank: 8}", "train.parallel.strategy=auto",
                                     "train.parallel.mixed_precision=fp32", "train.parallel.cpu_offload=false",
                                     "train.parallel.reshard_after_forward=false"])
    from_dict(Recipe, fixed)


def test_problems_of_several_sections_are_listed_together(capsys):
    overrides = ["train.optim.lr=0", "train.ema.decay=2", "loader.num_workers=-1", "train.nope=1",
                 "train.micro_batch_size=four", "train.phases.0.steps=-3"]
    with pytest.raises(ConfigError) as e:
        load_recipe(TINY, overrides)
    paths = sorted(p.text.split(": ", 1)[0] for p in e.value.problems)
    assert paths == sorted(["train.optim.lr", "train.ema.decay", "loader.num_workers", "train.nope",
                            "train.micro_batch_size", "train.phases[0].steps"])
    assert str(e.value).count("\n") == len(paths) - 1
    assert main(["config", "show", "--recipe", TINY, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == len(paths) and all(line.startswith("latentforge: error: ") for line in err)
