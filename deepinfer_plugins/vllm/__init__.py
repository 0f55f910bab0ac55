"""vLLM adapter: translates vLLM's batches, paged caches and API layer onto the framework-neutral core."""
