"""What a run drives: the target parsed once, the engines the harness starts, their processes."""
