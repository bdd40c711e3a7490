"""`runtime bench`: every method interleaved on the same prompts in one process, ratios in one run."""
