"""What a run is: its config and where that comes from, and the settings that make it the same run.

* :mod:`.train_config`: the dataclasses whose field help becomes the CLI help, their validation and TOML form;
* :mod:`.config_sources`: defaults < a TOML file < flags, and a checkpoint's stored config read back;
* :mod:`.identity`: the settings that define a run, their fingerprint, the default run directory (its name), what
  may change on resume.
"""
