"""The `bench` command line: a thin layer over the library that composes runs from flags."""

from harness.cli.main import bench, main

__all__ = ["bench", "main"]
