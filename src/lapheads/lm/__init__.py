"""Language-model pieces: tokenizer, sampling, chat evaluation and the code sandbox."""
