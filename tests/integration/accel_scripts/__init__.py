"""Scripts launched by the accelerate integration tests, and their test harness."""
