"""What every kernel is written with: the jit decorator, element types, shared types, the variant
convention, tile configurations."""
