"""Observation: step records and their sinks (console, JSONL, TensorBoard, W&B), and reports read back from a
run's metrics.
"""
