"""Planning a GPU run before it starts: ``memory_model`` (per-GPU memory and traffic of a layout)."""
