"""``latentforge eval``'s config: generation settings, inputs and metric models. Apart from the
evaluation itself (evaluate/eval.py), as a training run's config holds one too (train/run_files.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from latentforge.errors import Problems
from latentforge.evaluate.features import INCEPTION_FEATURES


@dataclass
class EvalConfig:
    """``latentforge eval``: generation settings, inputs and metric models (all local paths)."""

    checkpoint: str = field(default="", metadata={
        "help": "a checkpoint directory, a run directory (its newest complete checkpoint) or an exported diffusers "
                "directory (model_index.json)"})
    use_ema: bool = field(default=True, metadata={"help": "checkpoints: generate with the EMA weights"})
    prompts: str = field(default="", metadata={
        "help": "prompt source: a text file (one per line), a .jsonl or .parquet file (prompt_column), or raw shards "
                "from ingest (their captions)"})
    prompt_column: str = field(default="caption", metadata={"help": "the prompt column of a .jsonl / .parquet file"})
    reference: str = field(default="", metadata={
        "help": "reference images for FID/KID/FD: raw shards from ingest or an image folder"})
    max_reference: int = field(default=0, metadata={"help": "use the first N reference images; 0 = all"})
    num_images: int = field(default=0, metadata={
        "help": "images per guidance scale; prompts are taken in order and repeated as needed; 0 = one per prompt"})
    guidance_scales: list[float] = field(default_factory=lambda: [5.0], metadata={
        "help": "classifier-free guidance scales, each evaluated on the same prompts and seeds"})
    num_steps: int = field(default=30, metadata={"help": "sampler steps"})
    sampler: Literal["ddim", "dpm++", "euler", "ddpm"] = field(default="ddim", metadata={
        "help": "checkpoints: the sampler (a diffusers directory uses its own scheduler)"})
    seed: int = field(default=0, metadata={"help": "batch b is sampled with seed + b"})
    batch_size: int = field(default=16, metadata={"help": "images per generation and feature-extraction batch"})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu or cuda"})
    inception: str = field(default="", metadata={
        "help": "FID/KID: the Inception-v3 weights file (pt_inception-2015-12-05-6726825d.pth or .safetensors)"})
    inception_feature: int = field(default=2048, metadata={
        "help": "Inception feature layer: 2048 (the standard FID/KID), or 64/192/768"})
    kid_subset_size: int = field(default=1000, metadata={"help": "KID: images per subset (both sides need this many)"})
    kid_subsets: int = field(default=100, metadata={"help": "KID: number of random subsets"})
    fd_encoders: list[str] = field(default_factory=list, metadata={
        "help": "image encoder directories (DINOv2, CLIP) for the Fréchet distance in their features, fd_<dir name>"})
    clip: str = field(default="", metadata={"help": "CLIP score: a transformers CLIPModel directory with its processor"})
    plot_metric: str = field(default="", metadata={
        "help": "the distribution metric on the plot's y axis (fid, kid or fd_<name>); default: fid, else the first fd"})
    cache_dir: str = field(default="", metadata={
        "help": "reference-feature cache when the reference directory is read-only or remote; "
                "default ~/.cache/latentforge/eval"})

    def validate(self) -> None:
        problems = Problems()
        if not self.guidance_scales:
            problems.add("guidance_scales: empty; give at least one scale, e.g. [1, 2, 4, 8]")
        if any(g < 0 for g in self.guidance_scales):
            problems.add(f"guidance_scales: must be >= 0, got {self.guidance_scales}")
        if len(set(self.guidance_scales)) != len(self.guidance_scales):
            problems.add(f"guidance_scales: duplicates in {self.guidance_scales}")
        for name in ("num_steps", "batch_size", "kid_subsets"):
            if getattr(self, name) < 1:
                problems.add(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.kid_subset_size < 2:
            problems.add(f"kid_subset_size: must be >= 2, got {self.kid_subset_size}")
        for name in ("num_images", "max_reference"):
            if getattr(self, name) < 0:
                problems.add(f"{name}: must be >= 0, got {getattr(self, name)}; 0 = all")
        if self.inception_feature not in INCEPTION_FEATURES:
            problems.add(f"inception_feature: must be one of {', '.join(map(str, INCEPTION_FEATURES))}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            problems.add(f"device: unknown {self.device!r}; use auto, cpu, cuda or cuda:N")
        problems.raise_if_any()
