"""Language-model pieces: the model, tokenizer, sampling, and chat evaluation through lm-evaluation-harness."""
