"""portep benchmarks."""
