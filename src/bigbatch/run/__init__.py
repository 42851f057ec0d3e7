"""A training run, in four sub-packages:

* :mod:`.configuration`: what the run is: its config, where that comes from, the run's identity and name;
* :mod:`.build`: every part of the run, built from its config in phases;
* :mod:`.checkpoints`: the checkpoint files and what they hold: the named train state, resume and branches;
* :mod:`.loop`: the training loop and what it runs beside the steps: logging, evaluation, saves and stops, the
  header, fault injection, the run directory's files and lock.
"""
