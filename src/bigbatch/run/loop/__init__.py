"""The training loop and what it runs beside the steps.

* :mod:`.trainer`: :class:`~.trainer.Trainer`, the loop: step, log, evaluate, save, stop;
* :mod:`.tally`: what the loop has seen so far (the last step, throughput, skips, a stop, positions);
* :mod:`.step_log`: where each step's record goes: the metrics sinks and the step's line, with MFU; and
  ``--batch-ramp auto`` grown from the noise scale a step measured;
* :mod:`.evaluation`: evaluation and sampling during training;
* :mod:`.validation_loss`: a model's loss on the validation windows (what evaluations log and ``bigbatch eval``
  prints);
* :mod:`.stopping`: when the loop saves; a stop request at a step boundary, a second Ctrl-C, a diverging run;
* :mod:`.summary`: the lines a run ends with;
* :mod:`.header`: the lines a run prints before its first step;
* :mod:`.faults`: fault injection for the reliability tests, a step hook;
* :mod:`.run_dir_files`: what a run keeps in its directory beside the checkpoints;
* :mod:`.run_dir_lock`: one writer per run directory.
"""
