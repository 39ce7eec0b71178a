"""Helpers shared by every other package; this package imports none of them."""
