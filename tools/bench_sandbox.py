"""Measure the code sandbox: one sandbox process per program vs one batched sandbox per batch.

Arms per_program and batched, interleaved over --rounds after one untimed round
(bench_harness.Bench.run); metrics seconds and programs_per_s per round, params isolation,
programs, cases_per_program; the bench_harness CSV schema on stdout or --out (with its
.summary.csv: medians, min = the old best of, ratios to per_program).
Example: python tools/bench_sandbox.py --programs 32 --cases 4 --out bench.csv
"""

import argparse
import sys

from bench_harness import Bench, NoResult, print_summary, timed

from megatron_sdpo.rewards.sandbox import Program, Sandbox, SandboxLimits, isolation_mode

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=32)
    parser.add_argument("--cases", type=int, default=4)
    parser.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=3)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    sandbox = Sandbox(SandboxLimits(timeout_s=2.0))
    programs = [Program(PROGRAM, [f"{i} {j}" for j in range(args.cases)]) for i in range(args.programs)]

    def arm(batched: bool):
        def measure() -> dict:
            outcomes = []
            seconds, _ = timed(lambda: outcomes.extend(sandbox.run_batch(programs, batched=batched)))
            if not all(o.status == "ok" for program in outcomes for o in program):
                raise NoResult("failed", f"benchmark program failed: {outcomes[0]}")
            return {"seconds": seconds, "programs_per_s": args.programs / seconds}

        return measure

    bench = Bench("sandbox", units={"seconds": "s", "programs_per_s": "1/s"}, out=args.out, baseline="per_program")
    bench.run(
        {"per_program": arm(False), "batched": arm(True)},
        rounds=args.rounds,
        warmup=1,
        params={"isolation": isolation_mode(), "programs": args.programs, "cases_per_program": args.cases},
    )
    summary = bench.write()
    print_summary(summary, file=sys.stderr if args.out == "-" else sys.stdout)
    if any(s["metric"] == "failed" for s in summary):
        sys.exit(1)


if __name__ == "__main__":
    main()
