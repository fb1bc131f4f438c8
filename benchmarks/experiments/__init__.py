"""Dated experiments: frozen investigations and micro-benchmarks, not the product's suite.

Each module measured one question once (its docstring says which, how to run it again and
where the result is written up); constants in the package cite them. They are kept so that
a reader can rerun the measurement, not maintained as a suite: benchmarks/README.md lists them.
"""
