"""The critical batch size, measured directly by branching short runs from one checkpoint: the rules (sizes,
budget, learning rate, which size is critical), the measurement that trains the branches, and its result."""
