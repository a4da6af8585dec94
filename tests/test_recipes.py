"""Every shipped recipe loads and validates against the config schema."""

from pathlib import Path

import pytest
import yaml

from latentforge.config import to_dict
from latentforge.recipe import RECIPES_DIR, Recipe, load_recipe

RECIPES = sorted(Path(RECIPES_DIR).glob("*.yaml"))


def test_there_are_recipes():
    assert any(p.stem == "tiny-cpu" for p in RECIPES)
    assert [p.stem for p in BUILT_IN_DATA] == ["tiny-cpu"]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads(path):
    recipe = load_recipe(str(path))
    assert isinstance(recipe, Recipe) and recipe.name == path.stem
    # what is saved next to outputs loads back to the same config
    from latentforge.config import from_dict

    assert from_dict(Recipe, to_dict(recipe)) == recipe


def test_recipe_by_name_and_override():
    r = load_recipe("tiny-cpu", ["ingest.image.resolution=64"])
    assert r.ingest.image.resolution == 64


BUILT_IN_DATA = [p for p in RECIPES if "synth" in (yaml.safe_load(p.read_text()) or {})]


@pytest.mark.parametrize("path", BUILT_IN_DATA, ids=lambda p: p.stem)
def test_the_built_in_dataset_passes_each_recipes_ingest_filters(path):
    """Recipes with a synth section (the demo's) render synth.image_size px squares and ingest them
    with their own filters (tiny-cpu: 64 px rendered, 32 px ingested, min_side 32): none may be
    filtered out."""
    import io

    from PIL import Image

    from latentforge.data.imageproc import process_image, size_limits

    recipe = load_recipe(str(path))
    side = recipe.synth.image_size
    min_side, max_aspect = size_limits(recipe.ingest.filters, recipe.ingest.image)
    assert side >= min_side and (max_aspect == 0 or max_aspect >= 1)
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 200, 30)).save(buf, format="PNG")
    out = process_image(buf.getvalue(), recipe.ingest.image, recipe.ingest.filters)
    assert out.width == out.height == recipe.ingest.image.resolution or recipe.ingest.image.crop == "buckets"
