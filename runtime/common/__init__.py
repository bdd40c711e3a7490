"""What every layer of the runtime shares: sampling, decoding stats, numerics and the checks of a caller's values."""
