"""What a saved run gives: evaluation, samples, and a Hugging Face export."""
