"""Measurements of built artifacts: latency, throughput and memory of greedy decoding."""
