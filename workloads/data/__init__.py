"""Bundled data: the prompt corpus and derived length quantiles."""
