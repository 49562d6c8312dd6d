"""Issue 47's cold job at scale: no_stall vs the compile pool vs single-flight, from 8 to 1024 ranks.

    python benchmarks/pool_projection.py [--ranks 8 16 ... 1024] [--steps 3 30]

The measured job (``benchmarks/cold_bench.py --no-stall``, docs/benchmarks.md, "No-stall"; issue 47): a small
GPT under DDP on 2 ranks, 4 sequence lengths trained by every rank and an evaluation only rank 0 runs; its
cold job compiled 6 graphs behind the steps, rank 0 4 of them in 52.3 s, rank 1 2 in 36.7 s (14.8 s a graph
on average), in 3 iterations of about 11 s of steps, and ended at 73.6 s, waiting for the compiles within its
exit grace. The simulator's workload for it: schedule ``startup`` (every rank meets the shared graphs in
iteration 0 and calls them every iteration) with ``--shared-shapes`` graphs, plus ``--rank0-shapes`` graphs
only rank 0 meets; a step is an iteration. Each row prints the job's wall (its steps), when its last compile
lands (``end_s``: wall plus the tail the exit grace waits for), iteration 0, and how the compile seconds fell
on the ranks' workers (under no_stall and pool the part behind the steps, each rank paying its traces in its
steps; under single-flight whole compiles, in the steps).

The simulator breaks ties to the lower rank, so at job start rank 0 leads every graph (the real lease goes to
whichever rank asks first): no_stall's figures are the worst case of its spread, pool's hardly depend on it.
"""

from __future__ import annotations

import argparse

from recipecache.sim import Costs, Scenario, compare

POLICIES = ("no_stall", "pool", "singleflight")
#: the options that are :class:`~recipecache.sim.Costs` fields of the same name; the rest keep its defaults
COST_OPTIONS = ("compile_s", "trace_s", "compute_s", "artifact_mb", "pool_poll_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8 << k for k in range(8)])
    ap.add_argument("--steps", type=int, nargs="+", default=[3, 30], help="iterations of the job, one table each")
    ap.add_argument("--shared-shapes", type=int, default=4, help="graphs every rank meets (the training lengths)")
    ap.add_argument("--rank0-shapes", type=int, default=2, help="graphs only rank 0 meets (its evaluation)")
    ap.add_argument("--compile-s", type=float, default=14.8, help="a graph's compile: (52.3 + 36.7) s / 6 graphs")
    ap.add_argument("--trace-s", type=float, default=1.5, help="the synchronous trace inside each compile")
    ap.add_argument("--compute-s", type=float, default=1.0, help="an iteration's compute, compiled")
    ap.add_argument("--artifact-mb", type=float, default=2.0)
    ap.add_argument("--pool-poll-s", type=float, default=0.5)
    args = ap.parse_args()
    costs = Costs(**{name: getattr(args, name) for name in COST_OPTIONS})
    for steps in args.steps:
        print(
            f"\n{steps} iterations; {args.shared_shapes} graphs on every rank + {args.rank0_shapes} on rank 0 only, "
            f"{args.compile_s:g} s a compile ({args.trace_s:g} s of it traced), {args.compute_s:g} s an iteration"
        )
        print(
            f"{'ranks':>6} {'policy':<13}{'wall_s':>8}{'end_s':>8}{'iter0_s':>9}{'largest_s':>11}{'mean_s':>8}"
            f"{'largest/mean':>14}{'handoffs':>10}{'eager':>7}"
        )
        for ranks in args.ranks:
            scenario = Scenario(
                schedule="startup",
                ranks=ranks,
                shapes=args.shared_shapes,
                steps=steps,
                costs=costs,
                rank0_shapes=args.rank0_shapes,
            )
            for policy, r in compare(POLICIES, scenario).items():
                largest = max(x.compile_s for x in r.per_rank)
                balance = "-" if r.compile_balance is None else f"{r.compile_balance:.2f}"
                print(
                    f"{ranks:>6} {policy:<13}{r.wall_s:>8.1f}{r.wall_s + r.tail_s:>8.1f}{r.first_step_s:>9.1f}"
                    f"{largest:>11.1f}{r.compile_s / ranks:>8.2f}{balance:>14}{r.handoffs:>10}{r.eager_steps:>7}"
                )


if __name__ == "__main__":
    main()
