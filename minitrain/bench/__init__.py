"""Benchmarks: each prints time ratios against a named peer, measured side by side in one run.

Absolute times on shared machines mean little; ratios from one process run are what to read.
"""
