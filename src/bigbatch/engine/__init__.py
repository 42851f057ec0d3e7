"""The engine: one optimizer step from K micro-batches (the batch, the accumulation, step hooks, the optimizer,
random state).
"""
