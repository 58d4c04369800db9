"""The plan from configs alone, no weights: the printout (report.py) and the memory estimate
(memory.py: the model's layout on the meta device; estimate.py: the arithmetic, activations.py: one
block's share of it; tables.py: the estimate's tables in docs/distributed.md)."""
