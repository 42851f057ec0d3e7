"""The checkpoint files and what they hold.

* :mod:`.checkpoint`: atomic save with a commit marker and checksum, verified load, retention;
* :mod:`.state`: the train state: the run's named stateful parts, saved and restored through one pair of methods;
* :mod:`.resume`: whether a run continues, whether a checkpoint fits it, the schedule it keeps;
* :mod:`.branch`: a new run started from another run's checkpoint.
"""
