"""The ``hf:DIR`` family: any local Hugging Face causal LM."""
