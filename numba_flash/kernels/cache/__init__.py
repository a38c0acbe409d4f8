"""KV-cache kernels: appending new tokens (append) and rotary embeddings (rotary)."""
