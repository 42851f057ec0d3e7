"""Parallelism and launching: the distributed context on PyTorch's own engine, torchrun's agent, workers that
live and die together, polite stops.
"""
