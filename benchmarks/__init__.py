"""checkrun benchmarks (run with ``python -m benchmarks``); not part of the test suite."""
