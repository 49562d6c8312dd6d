"""The graph store: torch's own cache entries (FX graphs, AOTAutograd, autotuning, PGO decisions) and the
CPU-feature probes, shared through the store with one compile per key (:mod:`.hooks`).
"""
