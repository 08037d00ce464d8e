"""The sections of the configuration schema, one module per concern; ``config/schema.py`` nests
them in :class:`~hybridrl.config.schema.Config` and re-exports every name."""
