"""The Llama family: the model and its Hugging Face conversion."""
