"""engine_ref package."""
