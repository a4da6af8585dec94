"""Typed configs: dataclasses loaded from YAML recipes with dotted overrides, validated on load.

Every component owns a small ``@dataclass`` config with a ``help`` string per field
(``field(default=..., metadata={"help": ...})``). :func:`from_dict` builds one from plain data
and rejects unknown keys and wrong types with a :class:`ConfigError` that names the dotted path
of the field; components add their own consistency checks in a ``validate()`` method that
raises :class:`ConfigError` too, with field names relative to the component (``rank: ...``):
:func:`from_dict` prefixes the path of the section, so messages name the exact YAML path
(``train.lora.rank: ...``). Every problem of a configuration is collected (unknown keys, wrong
types, failed checks, across all nested sections) and raised as one ``ConfigError`` that lists
them one per line; the CLI prints each line and exits with code 2.

No string in a config ever names code to import: components are chosen by plain names that
the code maps to builders itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from latentforge.errors import ConfigError, Problems

__all__ = [
    "ConfigError",
    "Problems",
    "field_help",
    "from_dict",
    "to_dict",
    "with_defaults",
    "apply_overrides",
    "load_yaml",
    "load_config",
    "save_config",
]


def field_help(cfg_cls: type) -> dict[str, str]:
    """The ``help`` text of each field of a config dataclass (for ``--help`` and docs)."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cfg_cls)}


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _describe(tp: Any) -> str:
    """``int | Literal["auto"]`` -> ``an integer or 'auto'``: the accepted values, for messages."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp) if a is not type(None))
    if origin is Literal:
        return " or ".join(map(repr, get_args(tp)))
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
             tuple: "a list", dict: "a mapping"}
    return names.get(origin or tp, "a mapping" if dataclasses.is_dataclass(tp) else _type_name(tp))


def _same_shape(value: Any, tp: Any) -> bool:
    """Whether ``value`` has the container shape ``tp`` expects (a mapping for a dataclass or
    dict, a list for a list or tuple), so that an error inside it is about its content."""
    origin = get_origin(tp) or tp
    if isinstance(value, dict):
        return origin is dict or dataclasses.is_dataclass(tp)
    if isinstance(value, (list, tuple)):
        return origin in (list, tuple)
    return False


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and return it in canonical form."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append((arg, e))
        # A value of the shape of exactly one alternative (a mapping for `EMAConfig | None`) failed
        # inside it: its own message names the field that is wrong (train.ema.decay), so pass it on.
        shaped = [e for arg, e in errors if _same_shape(value, arg)]
        if len(shaped) == 1:
            raise shaped[0]
        raise ConfigError(f"{path}: expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item_tp = args[0] if args else Any
        try:
            items = _collect([(f"{path}[{i}]", item_tp, v) for i, v in enumerate(value)])
        except ConfigError as e:
            if origin is tuple and hasattr(e, "partial"):
                e.partial = tuple(e.partial)
            raise
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        ktp, vtp = get_args(tp) or (Any, Any)
        keys = _collect([(f"{path}.{k}", ktp, k) for k in value])
        return dict(zip(keys, _collect([(f"{path}.{k}", vtp, v) for k, v in value.items()])))
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-4 (no dot) as a string: accept any spelling of a number.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML reads .inf and .nan; no setting means them
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported config type {_type_name(tp)}")


_NONE = object()


def _collect(items: list[tuple[str, Any, Any]]) -> list[Any]:
    """``_coerce`` each (path, type, value), raising one ConfigError with the problems of all of them
    (its ``partial``: the values, if each was at least built, see :func:`from_dict`)."""
    out, problems = [], []
    for path, tp, value in items:
        try:
            out.append(_coerce(value, tp, path))
        except ConfigError as e:
            problems.extend(e.problems)
            out.append(getattr(e, "partial", _NONE))
    if problems:
        err = ConfigError(problems=problems)
        if all(v is not _NONE for v in out):
            err.partial = out
        raise err
    return out


def _field_of(text: str, path: str) -> str:
    """The field of this section that the problem ``text`` (a full dotted path, then ``:``) is about."""
    rest = text.split(":", 1)[0][len(path) + 1 if path else 0:]
    return rest.split(".", 1)[0].split("[", 1)[0]


def from_dict(cfg_cls: type, data: Any, path: str = "") -> Any:
    """Build the dataclass ``cfg_cls`` from a mapping, validating keys, types and consistency.

    Every problem is collected, also those of nested sections and of the section's own
    ``validate()`` (whose field names are relative: this function prefixes ``path``), and raised
    as one :class:`ConfigError`. A nested section that was built but failed its own checks keeps
    its values for this section's ``validate()`` (the error's ``partial``), so that checks across
    fields see what the recipe says; a field whose value could not be read at all (a wrong type)
    takes its default there, and this section's problems about that field are left out."""
    where = path or cfg_cls.__name__
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cfg_cls)
    fields = {f.name: f for f in dataclasses.fields(cfg_cls) if f.init}

    def key(name: str) -> str:
        return f"{path}.{name}" if path else name

    problems = Problems()
    for name in sorted(set(data) - set(fields)):
        problems.add(f"{key(name)}: unknown key; valid keys here: {', '.join(sorted(fields))}")
    kwargs, refused = {}, set()
    for name, value in data.items():
        if name not in fields:
            continue
        try:
            kwargs[name] = _coerce(value, hints[name], key(name))
        except ConfigError as e:
            problems.items.extend(e.problems)
            if hasattr(e, "partial"):
                kwargs[name] = e.partial
            else:
                refused.add(name)
    unset = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for name in unset:
        if name not in data:
            problems.add(f"{key(name)}: required but not set")
    if unset:  # the section cannot be built to check the rest
        problems.raise_if_any()
    cfg = cfg_cls(**kwargs)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as e:
            # Components name their fields relative to themselves; prefix the path of this section.
            problems.items.extend(p for p in e.prefixed(path).problems if _field_of(p.text, path) not in refused)
    if problems:
        err = ConfigError(problems=problems.items)
        if not refused:
            err.partial = cfg  # built, with every value the recipe gave: the enclosing section can check it
        raise err
    return cfg


def to_dict(cfg: Any) -> Any:
    """Plain data (dicts, lists, scalars) for a config, suitable for YAML/JSON."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def with_defaults(saved: Any, defaults: Any) -> Any:
    """``saved`` (a config read back from a file an earlier run wrote) with every key it lacks, at any
    depth, taken from ``defaults``. A field added to a config class after that file was written then
    reads as its default, which keeps what the earlier code did (a new option is off by default), so a
    rerun after an upgrade resumes the stage instead of refusing its output."""
    if not isinstance(saved, dict) or not isinstance(defaults, dict):
        return saved
    return {**defaults, **{k: with_defaults(v, defaults.get(k)) for k, v in saved.items()}}


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML) to plain config data.

    List items are addressed by index (``phases.1.steps=100``).
    """
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for text in overrides:
        keys, value = _parse_override(text)
        node: Any = data
        for i, k in enumerate(keys[:-1]):
            where = ".".join(keys[: i + 1])
            if isinstance(node, list):
                if not k.isdigit() or int(k) >= len(node):
                    raise ConfigError(f"{where}: no list item {k}")
                node = node[int(k)]
                continue
            if node.get(k) is None:
                node[k] = {}
            node = node[k]
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"{where}: is a value, cannot set {keys[i + 1]!r} inside it")
        last = keys[-1]
        if isinstance(node, list):
            if not last.isdigit() or int(last) >= len(node):
                raise ConfigError(f"{'.'.join(keys)}: no list item {last}")
            node[int(last)] = value
        else:
            node[last] = value
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (lines {first} and {line})", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"recipe {path}: is a directory; give a YAML file or a recipe name")
    if not path.is_file():
        raise ConfigError(f"recipe {path}: file not found")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe {path}: not UTF-8 text (byte {e.start})") from None
    except yaml.constructor.ConstructorError as e:
        raise ConfigError(f"recipe {path}: {e.problem}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"recipe {path}{where}: invalid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"recipe {path}: top level must be a mapping")
    try:
        json.dumps(data, default=str)  # plain data from here on: no node may contain itself
    except ValueError:
        raise ConfigError(f"recipe {path}: refers to itself (a YAML alias inside its own anchor)") from None
    return data


def load_config(cfg_cls: type, recipe: str | Path | None = None, overrides: list[str] | None = None) -> Any:
    """Load ``cfg_cls`` from an optional YAML recipe plus dotted overrides."""
    data = load_yaml(recipe) if recipe else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(cfg_cls, data)


def save_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML (next to every output, for provenance)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    tmp.replace(path)
