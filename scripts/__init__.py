"""Developer tools; ``scripts.devcluster`` drives the dev cluster (importable from the repository root)."""
