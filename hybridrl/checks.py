"""Checks of a whole config that need more than its schema (plug-ins resolve, optional packages are
installed), run before any work starts by the command line and the Python API alike."""

from __future__ import annotations

from hybridrl.config import Config


def check_config(cfg: Config) -> None:
    """Raises :class:`~hybridrl.config.ConfigError` (one line) for the first problem found."""
    from hybridrl import cli

    cli.check_plugins(cfg)
    cli.check_loggers(cfg)
