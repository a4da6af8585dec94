"""Every shipped recipe loads and validates against the config schema."""

from pathlib import Path

import pytest

from latentforge.config import to_dict
from latentforge.recipe import RECIPES_DIR, Recipe, load_recipe

RECIPES = sorted(Path(RECIPES_DIR).glob("*.yaml"))


def test_there_are_recipes():
    assert any(p.stem == "tiny-cpu" for p in RECIPES)


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
