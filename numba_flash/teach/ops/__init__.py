"""The teaching kernels' host ops (validation, launch, results)."""
