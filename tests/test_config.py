"""The typed config system: types, unknown keys, overrides, validation messages."""

from dataclasses import dataclass, field
from typing import Literal

import pytest

from latentforge.config import ConfigError, apply_overrides, from_dict, load_config, load_yaml, to_dict


@dataclass
class Inner:
    rate: float = field(default=0.1, metadata={"help": "a rate"})
    mode: Literal["a", "b"] = "a"

    def validate(self):
        if not 0 <= self.rate < 1:
            raise ConfigError("rate: must be in [0, 1)")


@dataclass
class Outer:
    steps: int = 10
    name: str = "x"
    sizes: list[int] = field(default_factory=lambda: [1, 2])
    inner: Inner = field(default_factory=Inner)
    opt: int | None = None
    table: dict[str, float] = field(default_factory=dict)


def test_defaults_and_round_trip():
    cfg = from_dict(Outer, {})
    assert cfg == Outer()
    assert from_dict(Outer, to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "data, message",
    [
        ({"stepz": 1}, "stepz: unknown key"),
        ({"steps": "many"}, "steps: expected an integer"),
        ({"steps": True}, "steps: expected an integer"),
        ({"inner": {"rate": 2.0}}, "inner.rate: must be in [0, 1)"),
        ({"inner": {"mode": "c"}}, "inner.mode: must be one of"),
        ({"inner": {"nope": 1}}, "inner.nope: unknown key"),
        ({"sizes": [1, "x"]}, "sizes[1]: expected an integer"),
        ({"table": {"a": "b"}}, "table.a: expected a number"),
    ],
)
def test_errors_name_the_field(data, message):
    with pytest.raises(ConfigError) as e:
        from_dict(Outer, data)
    assert str(e.value).startswith(message), str(e.value)


def test_int_accepted_for_float_and_optional():
    cfg = from_dict(Outer, {"inner": {"rate": 0}, "opt": None})
    assert cfg.inner.rate == 0.0 and isinstance(cfg.inner.rate, float)
    assert from_dict(Outer, {"opt": 3}).opt == 3


def test_overrides_parse_yaml_values_and_nest():
    data = apply_overrides({"steps": 1}, ["steps=5", "inner.rate=0.5", "name=hello world", "sizes=[3, 4]"])
    cfg = from_dict(Outer, data)
    assert (cfg.steps, cfg.inner.rate, cfg.name, cfg.sizes) == (5, 0.5, "hello world", [3, 4])


def test_override_list_items_and_errors():
    assert apply_overrides({"a": [{"x": 1}, {"x": 2}]}, ["a.1.x=7"]) == {"a": [{"x": 1}, {"x": 7}]}
    with pytest.raises(ConfigError, match="a.5: no list item"):
        apply_overrides({"a": [{"x": 1}]}, ["a.5.x=1"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_overrides({}, ["nonsense"])
    with pytest.raises(ConfigError, match="steps: is a value"):
        apply_overrides({"steps": 1}, ["steps.x=1"])


def test_load_config_from_yaml(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("steps: 3\ninner:\n  mode: b\n")
    cfg = load_config(Outer, p, ["inner.rate=0.2"])
    assert (cfg.steps, cfg.inner.mode, cfg.inner.rate) == (3, "b", 0.2)
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(Outer, bad)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(Outer, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="is a directory; give a YAML file"):
        load_config(Outer, tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"steps: 3\n\xff\xfe")
    with pytest.raises(ConfigError, match=r"binary.yaml: not UTF-8 text \(byte 9\)"):
        load_config(Outer, binary)
    circular = tmp_path / "alias.yaml"  # was json's "Circular reference detected" traceback
    circular.write_text("inner: &a\n  x: *a\n")
    with pytest.raises(ConfigError, match=r"alias.yaml: refers to itself \(a YAML alias inside its own anchor\)$"):
        load_config(Outer, circular)
    shared = tmp_path / "shared.yaml"  # an alias used elsewhere is fine
    shared.write_text("base: &b\n  mode: b\ninner: *b\n")
    assert load_yaml(shared)["inner"] == {"mode": "b"}


def test_recipe_key_given_twice_is_refused(tmp_path):
    # PyYAML keeps the last of two equal keys; a recipe edited in two places would train on one silently.
    p = tmp_path / "twice.yaml"
    p.write_text("steps: 3\ninner:\n  mode: b\nsteps: 5\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: key 'steps' given twice \(lines 1 and 4\)"):
        load_config(Outer, p)
    p.write_text("inner: {rate: 0.1, rate: 0.2}\n")
    with pytest.raises(ConfigError, match=r"key 'rate' given twice \(lines 1 and 1\)"):
        load_config(Outer, p)
    p.write_text("steps: 3\ninner: {mode: b}\nother: {mode: b}\n")  # equal keys in different mappings are fine
    with pytest.raises(ConfigError, match="other: unknown key"):
        load_config(Outer, p)


@pytest.mark.parametrize("text", [".inf", "-.inf", ".nan", "inf", "nan"])
def test_float_must_be_finite(text):
    with pytest.raises(ConfigError, match="inner.rate: expected a finite number"):
        from_dict(Outer, apply_overrides({}, [f"inner.rate={text}"]))


def test_float_written_without_a_dot():
    cfg = from_dict(Outer, apply_overrides({}, ["inner.rate=1e-4"]))
    assert cfg.inner.rate == 1e-4
    with pytest.raises(ConfigError, match="inner.rate: expected a number"):
        from_dict(Outer, {"inner": {"rate": "fast"}})


# ------------------------------------------------------------------ optional sections of the recipe


def _optional_sections(cls, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted path, dataclass) of every ``SomeConfig | None`` field reachable from ``cls``
    through nested sections (list items are not walked: they have no defaults to reach them by)."""
    import dataclasses
    import types
    import typing

    found = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            found += _optional_sections(tp, path + ".")
        elif typing.get_origin(tp) in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if type(None) in typing.get_args(tp) and len(args) == 1 and dataclasses.is_dataclass(args[0]):
                found.append((path, args[0]))
                found += _optional_sections(args[0], path + ".")
    return found


def test_an_error_inside_an_optional_section_names_its_field():
    from latentforge.recipe import Recipe

    sections = _optional_sections(Recipe)
    assert {"train.ema", "train.lora"} <= {p for p, _ in sections}  # the walk reaches them
    for path, _ in sections:
        data: dict = {}
        node = data
        for key in path.split("."):
            node = node.setdefault(key, {})
        node["no_such_key"] = 1
        with pytest.raises(ConfigError) as e:
            from_dict(Recipe, data)
        assert str(e.value).startswith(f"{path}.no_such_key: unknown key"), str(e.value)
    with pytest.raises(ConfigError, match=r"^train\.ema\.decay: must be in \(0, 1\)"):
        from_dict(Recipe, {"train": {"ema": {"decay": 1.5}}})
    with pytest.raises(ConfigError, match=r"^train\.lora\.rank: expected an integer"):
        from_dict(Recipe, {"train": {"lora": {"rank": "big"}}})
    # A value of another shape still gets the type message of the union.
    with pytest.raises(ConfigError, match=r"^train\.ema: expected a mapping, got 3"):
        from_dict(Recipe, {"train": {"ema": 3}})
    assert from_dict(Recipe, {"train": {"ema": None}}).train.ema is None


def test_cli_config_errors_are_one_line(capsys):
    from latentforge.cli import main

    assert main(["config", "show", "--recipe", "tiny-cpu", "train.ema.decay=1.5"]) == 2
    err = capsys.readouterr().err
    assert err == "latentforge: error: train.ema.decay: must be in (0, 1), got 1.5\n"
    assert main(["config", "show", "--recipe", "tiny-cpu", "train.optim.lr"]) == 2
    err = capsys.readouterr().err
    assert err == "latentforge: error: override 'train.optim.lr': expected key.path=value\n"
