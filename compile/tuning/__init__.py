"""Maintainers' tools that drive compiles: record, tune and re-key the shipped kernel search; record the QCOM register tiles."""
