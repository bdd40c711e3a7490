"""specvocab prep: read a causal LM once and write versioned artifacts for the runtime."""
