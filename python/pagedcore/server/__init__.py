"""The OpenAI-compatible HTTP server (``pagedcore serve``)."""
