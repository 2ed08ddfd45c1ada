"""The engines' runtime: threads, weights, tokenizers, compile cache and guard, private directories."""
