"""Measure a compiled step on its device: latency with TVM's time evaluator."""
