"""Import llama-family GGUF files (llama.cpp's format) as mlx-lm model directories."""
