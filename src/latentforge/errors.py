"""Errors that the CLI reports as one line and exit code 2 (bad input, never a traceback)."""


class UserError(Exception):
    """Bad input from the user: a path that does not exist, a file of the wrong kind, a mismatch."""


class ConfigError(UserError, ValueError):
    """A config value that is unknown, of the wrong type or inconsistent; the message starts with
    the dotted name of the field."""
