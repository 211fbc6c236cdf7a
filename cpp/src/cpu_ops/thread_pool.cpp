// Placeholder: the CPU thread_pool implementation lands here.
