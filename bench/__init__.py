"""Benchmarks that compare mpoverlap's modes and torch peers in one run (`make bench`)."""
