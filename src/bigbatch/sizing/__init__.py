"""Sizing a step: the batch arithmetic, the batch-size ramp, memory estimated and measured, ``--micro-batch
auto``, ``bigbatch plan``'s table.
"""
