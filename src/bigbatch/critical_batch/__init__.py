"""The critical batch size, measured directly by branching short runs from one checkpoint."""
