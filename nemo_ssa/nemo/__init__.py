"""NeMo-aware code: data/forward steps, callbacks and the CPU training path."""
