"""Small reference models for benchmarks and examples (``longboat.models.ctr``)."""
