"""The package version (one place: ``pyproject.toml`` reads it, the CLI and the server report it)."""

__version__ = "0.1.0"
