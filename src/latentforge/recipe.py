"""A recipe: one YAML file with a section per component (see ``recipes/``).

Each section is the typed config of the component that owns it; a section left out of the
YAML takes that component's defaults. Commands read the sections they need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from latentforge.config import load_config
from latentforge.demo import DemoConfig
from latentforge.data.encode import EncodeConfig
from latentforge.data.ingest import IngestConfig
from latentforge.data.loader import LoaderConfig
from latentforge.data.synth import SynthConfig
from latentforge.evaluate.eval import EvalConfig
from latentforge.plan.cost import PlanConfig
from latentforge.train.trainer import TrainConfig
from latentforge.train.vae import VAETrainConfig


@dataclass
class Recipe:
    name: str = field(default="", metadata={"help": "short name of the recipe"})
    description: str = field(default="", metadata={"help": "what the recipe is for"})
    synth: SynthConfig = field(default_factory=SynthConfig, metadata={"help": "the built-in dataset"})
    ingest: IngestConfig = field(default_factory=IngestConfig, metadata={"help": "sources -> raw shards"})
    encode: EncodeConfig = field(default_factory=EncodeConfig, metadata={"help": "raw shards -> latent shards"})
    loader: LoaderConfig = field(default_factory=LoaderConfig, metadata={"help": "the training data loader"})
    vae: VAETrainConfig = field(default_factory=VAETrainConfig, metadata={"help": "train-vae: an autoencoder from scratch"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "train: the latent diffusion U-Net"})
    demo: DemoConfig = field(default_factory=DemoConfig, metadata={"help": "the demo's evaluation"})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"help": "eval: FID/KID/FD/CLIP score of a model"})
    plan: PlanConfig = field(default_factory=PlanConfig, metadata={"help": "plan: cluster, prices, throughputs"})


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def resolve_recipe_path(name_or_path: str) -> Path:
    """A path, or the name of a shipped recipe (``tiny-cpu`` -> ``recipes/tiny-cpu.yaml``)."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    return RECIPES_DIR / f"{name_or_path}.yaml"


def load_recipe(recipe: str | None, overrides: list[str] | None = None) -> Recipe:
    return load_config(Recipe, resolve_recipe_path(recipe) if recipe else None, overrides)
