"""Public operations: validate the arguments, move the arrays, pick and launch the kernel."""
