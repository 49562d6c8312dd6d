"""Run analysis: the per-process event log (:mod:`.events`), the key records beside it
(:mod:`.keyinfo`), and what ``recipecache explain`` / ``trace`` / ``report`` and the launcher's report make
of a run (:mod:`.explain`, :mod:`.timeline`, :mod:`.report`).
"""
