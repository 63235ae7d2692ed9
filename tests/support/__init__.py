"""Helpers shared by the unit and GPU tests: step cases, the bad-input matrix, GPU support."""
