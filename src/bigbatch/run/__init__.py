"""A training run: its config and where it comes from, the build in phases, the named state, the loop and its
validation, resume and branches, checkpoints, identity, run-directory files, header and lock, fault injection."""
