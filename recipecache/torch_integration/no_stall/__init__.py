"""No-stall: a graph that missed runs without inductor while one process compiles it behind the steps
(:mod:`.controller`), in a kept worker process (:mod:`.worker`).
"""
