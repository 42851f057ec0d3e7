"""A training run: its config, build, named state, loop, resume, checkpoints, run-directory files and lock."""
