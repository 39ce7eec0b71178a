"""`python -m harness.cli`: the `bench` command."""

from harness.cli.main import main

main()
