"""Benchmark commands of the project; each prints its figures and saves them as JSON."""
