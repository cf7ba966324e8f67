"""The one exception type for a bad pipeline config."""

from __future__ import annotations


class ConfigError(ValueError):
    """A pipeline config field is missing, malformed or not supported.

    CLIs print ``str(error)`` on stderr (one line; one line per error for
    :class:`ConfigErrors`) and exit with code 2.

    Attributes:
        field: dotted path of the offending field, e.g. ``train_config.num_steps`` or
            ``feature_configs[3].embedding_dim`` (``pipeline_config_path`` for file errors,
            ``edit_config_json`` for a malformed edit document).
        message: what is wrong, without the field name.

    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"invalid config field '{field}': {message}")

    def __reduce__(self):  # keeps the two-argument constructor picklable
        return (type(self), (self.field, self.message))


class ConfigErrors(ConfigError):
    """Several config errors found in one pass (each also a :class:`ConfigError`).

    ``field`` and ``message`` are the first error's; ``str()`` lists them all, one per line.

    Attributes:
        errors: the errors, in the order they were found.
    """

    def __init__(self, errors: list[ConfigError]) -> None:
        if not errors:
            raise ValueError("ConfigErrors needs at least one error")
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.field, first.message)
        lines = [f"{len(self.errors)} config errors:"] + [f"  {e}" for e in self.errors]
        self.args = ("\n".join(lines),)

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self):
        return (type(self), (self.errors,))


def raise_all(errors: list[ConfigError]) -> None:
    """Raises nothing for no errors, the error for one, :class:`ConfigErrors` for several."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)

