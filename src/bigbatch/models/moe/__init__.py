"""The mixture-of-experts family: the model, its router and its Hugging Face conversion."""
