"""Decoding loops: plain, chain speculative, token-tree (SWARM) and MJSD, with the verifiers they call."""
