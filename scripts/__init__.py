"""Developer tools; ``scripts.devcluster`` is the dev cluster's driver (importable from the repository root)."""
