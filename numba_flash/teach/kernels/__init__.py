"""The teaching kernels (one file each)."""
