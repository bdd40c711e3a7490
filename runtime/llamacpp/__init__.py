"""llama.cpp's plain decoding of the same GGUF, the bench's reference: in process (`bindings`) or its own server (`server`)."""
