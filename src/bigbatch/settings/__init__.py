"""Closed sets of choices and numeric ranges, declared once for config, validation, the CLI and docs."""
