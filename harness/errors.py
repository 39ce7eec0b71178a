"""Errors a user can cause; the CLI prints their one-sentence message and exits with code 2."""


class HarnessError(Exception):
    """A problem with the user's input or environment, described in one sentence."""
