"""Runtime: the only code that touches autograd to execute a plan.

:mod:`.executor` runs a chain under a plan (keep / recompute with RNG replay / page); :mod:`.batchnorm`
keeps BatchNorm running statistics full-batch exact under recomputation and micro-batching; :mod:`.paging`
pages saved tensors to a file through saved-tensor hooks; :mod:`.pool` is the CPU tensor pool (C++,
compiled on first use by :mod:`.native`).
"""

__all__: list[str] = []
