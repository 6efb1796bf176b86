"""Builds spread over several machines (Ray)."""
