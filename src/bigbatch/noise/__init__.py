"""The gradient noise scale, measured from the accumulation itself through a step hook."""
