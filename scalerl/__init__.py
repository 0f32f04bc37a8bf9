"""scalerl shared core: contracts, configuration, Redis schema, tasks, compute accounting."""

__version__ = "0.1.0"
