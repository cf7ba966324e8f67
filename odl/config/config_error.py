"""The one exception type for a bad pipeline config."""

from __future__ import annotations


class ConfigError(ValueError):
    """A pipeline config field is missing, malformed or not supported.

    CLIs print ``str(error)`` as one line on stderr and exit with code 2.

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
