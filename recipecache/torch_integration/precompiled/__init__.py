"""The precompiled tier: a fresh process loads whole compiled functions from the store instead of
tracing them (:mod:`.tier`), checked against the code and values they were traced from.
"""
