"""Generic (runtime-independent) passes; every public module here registers one pass."""
