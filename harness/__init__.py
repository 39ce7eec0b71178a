"""The harness: the `bench` CLI, targets, the load generator and the run recorder."""

__version__ = "0.1.0"
