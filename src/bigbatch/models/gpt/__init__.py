"""The GPT-2 family: the model and its Hugging Face conversion."""
