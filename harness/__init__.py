"""harness package."""
