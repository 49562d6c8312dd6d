"""How long a no-stall worker script waits for one event (a compile behind ending, a graph switched) before
it calls the wait a hang, and how long the tests give such a script.

These are hang guards, not guesses at how fast a machine compiles. Each script waits for the event
itself and fails with a message naming it when the guard runs out; it never goes on with partial results.
The scripts had 300-400 s: in a README test command run beside three others on 2 cores (issue 28), a
worker had not reached the second graph's compile within 300 s.
"""

#: seconds a worker script waits for one event
WORKER_HANG_GUARD_S = 1200.0
#: a test's subprocess timeout for such a script: above the guard, so the script's own message comes first
SCRIPT_TIMEOUT_S = WORKER_HANG_GUARD_S + 300.0
#: pytest-timeout for a test that runs one such script
TEST_TIMEOUT_S = SCRIPT_TIMEOUT_S + 300.0
