"""Errors that the CLI reports as one line per problem and exit code 2 (bad input, never a traceback)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable


class UserError(Exception):
    """Bad input from the user: a path that does not exist, a file of the wrong kind, a mismatch."""


@dataclass(frozen=True)
class Problem:
    """One problem of a configuration: ``text`` is ``<dotted.field.path>: <what is wrong>; <the fix>``;
    ``site`` is the (file, line) that found it, so that tests can tell every check was reached."""

    text: str
    site: tuple[str, int] = ("", 0)

    def prefixed(self, prefix: str) -> "Problem":
        return Problem(f"{prefix}.{self.text}" if prefix else self.text, self.site)


def _caller_site(depth: int) -> tuple[str, int]:
    frame = sys._getframe(depth + 1)
    return frame.f_code.co_filename, frame.f_lineno


class ConfigError(UserError, ValueError):
    """A config value that is unknown, of the wrong type or inconsistent. It holds one or more
    problems, each starting with the dotted path of its field; ``str()`` lists them one per line."""

    def __init__(self, message: str = "", *, problems: Iterable[Problem] | None = None):
        if problems is None:
            problems = [Problem(message, _caller_site(1))]
        unique: dict[str, Problem] = {}
        for p in problems:  # a check reached twice (a section validated again by its parent) counts once
            unique.setdefault(p.text, p)
        self.problems: list[Problem] = list(unique.values())
        super().__init__("\n".join(p.text for p in self.problems))

    def __reduce__(self) -> tuple[Any, ...]:  # pickled across processes (Ray, multiprocessing) with its problems
        return (_rebuild_config_error, (type(self), self.problems))

    def prefixed(self, prefix: str) -> "ConfigError":
        """The same problems, named from an enclosing section (``prefix`` = that section's path)."""
        return ConfigError(problems=[p.prefixed(prefix) for p in self.problems])


def _rebuild_config_error(cls: type, problems: list[Problem]) -> ConfigError:
    return cls(problems=problems)


class Problems:
    """Collects the problems of a config's ``validate()`` so that all of them are reported at once::

        problems = Problems()
        if self.rank < 1:
            problems.add(f"rank: must be >= 1, got {self.rank}; set a rank such as 8")
        problems.nested("interrupt", self.interrupt)
        problems.raise_if_any()
    """

    def __init__(self) -> None:
        self.items: list[Problem] = []

    def add(self, text: str) -> None:
        """One problem, ``<field>: <what is wrong>; <the fix>`` (field relative to the config)."""
        self.items.append(Problem(text, _caller_site(1)))

    def nested(self, prefix: str, cfg: Any) -> None:
        """The problems of a nested config ``cfg`` (its ``validate()``), named under ``prefix``."""
        try:
            cfg.validate()
        except ConfigError as e:
            self.items.extend(e.prefixed(prefix).problems)

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise ConfigError(problems=self.items)
