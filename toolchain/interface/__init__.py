"""The contract between an exported graph, the stages that rewrite it and the runtimes that run it: the graph's
input, output and metadata names and its KV cache (graph.py), the file names of a stage directory and of an
artifact (files.py), and the JSON documents the stages write about themselves (reports.py).

Everything that writes or reads graphs and artifacts imports this package; it imports none of them
(tests/test_import_graph.py)."""
