"""Proof that the accumulated gradient is the full-batch gradient, for any model.

:func:`check_equivalence` takes a model in training mode, one batch of tensors
(split along the first dimension) and a loss function, and compares

* the full-batch gradient: one forward/backward over all samples, loss = sum / N;
* the gradient the engine accumulates over the micro-batches of several
  *splits* of the same batch: equal pieces (``K`` of them), unequal pieces
  (sizes 1, 2, 3, ... and the remainder) and equal pieces of the samples in a
  random order, because a model that mixes neighbouring samples can pass one
  aligned split and fail any other;
* every buffer (running statistics, counters) after the step, both ways;
* the two classic mistakes on the equal split: no normalization (each
  micro-batch's mean loss back-propagated as is: K times too large) and
  ``mean / K`` (wrong whenever micro-batches hold different valid counts);
* the parameter update after one optimizer step taken both ways.

It names what breaks equivalence: modules with cross-sample statistics found by
type (BatchNorm of every kind in training mode, InstanceNorm with running
statistics), the smallest module (leaf or not, the model's own ``forward``
included) whose output on the full batch differs from its outputs on the
micro-batches while its inputs match, buffers that differ, and a loss function
that couples samples. Any of these makes the verdict NOT EQUIVALENT, whatever
the gradient tolerance. Dropout cannot match between one big batch and K small
ones (the masks differ), so it is switched off for the comparison and reported.

The loss function's signature is ``loss_fn(model, *tensors) -> (loss_sum, count)``:
the *sum* of per-item losses (e.g. per-token cross-entropies) and the number of
items it sums over. A loss that returns a mean ``m`` over ``c`` items returns
``(m * c, c)``.
"""

from bigbatch.models.coupling import ROOT
from bigbatch.verify.across_ranks import check_distributed_equivalence
from bigbatch.verify.equivalence import check_equivalence
from bigbatch.verify.inputs import (
    DEFAULT_TOLERANCE,
    SPLITS,
    OptimizerFactory,
    TensorBatch,
    VerifyLossFn,
    disable_dropout,
    lm_loss,
    scan_cross_sample_modules,
    split_indices,
)
from bigbatch.verify.verdict import (
    LOSS,
    BufferComparison,
    DistributedReport,
    EquivalenceReport,
    Finding,
    Mistake,
    ParamComparison,
    SplitResult,
)

__all__ = [
    "DEFAULT_TOLERANCE",
    "LOSS",
    "ROOT",
    "SPLITS",
    "BufferComparison",
    "DistributedReport",
    "EquivalenceReport",
    "Finding",
    "Mistake",
    "OptimizerFactory",
    "ParamComparison",
    "SplitResult",
    "TensorBatch",
    "VerifyLossFn",
    "check_distributed_equivalence",
    "check_equivalence",
    "disable_dropout",
    "lm_loss",
    "scan_cross_sample_modules",
    "split_indices",
]
