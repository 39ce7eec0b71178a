"""One run end to end (plan, drive, finish) and the sweeps, searches and comparisons of runs."""
