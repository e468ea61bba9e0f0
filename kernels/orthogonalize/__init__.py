"""Triton kernels of the orthogonalize op: the two GEMMs of a polar iteration step
(:mod:`.polar`)."""
