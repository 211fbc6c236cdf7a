// Placeholder: the CPU cache_ops implementation lands here.
