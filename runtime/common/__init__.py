"""What every layer of the runtime shares: sampling, decoding stats, numerics, the checks of a caller's
values and C-level output redirection."""
