// Placeholder: the CPU attention implementation lands here.
