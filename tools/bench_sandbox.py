"""Measure the code sandbox: one sandbox process per program vs one batched sandbox per batch.

Writes CSV rows (mode, isolation, programs, cases_per_program, seconds, programs_per_s) to stdout
or --out. Example: python tools/bench_sandbox.py --programs 32 --cases 4 --out bench.csv
"""
import argparse
import csv
import sys
import time

from megatron_sdpo.rewards.sandbox import Program, Sandbox, SandboxLimits, isolation_mode

PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=32)
    parser.add_argument("--cases", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="-")
    args = parser.parse_args()
    sandbox = Sandbox(SandboxLimits(timeout_s=2.0))
    programs = [Program(PROGRAM, [f"{i} {j}" for j in range(args.cases)])
                for i in range(args.programs)]
    mode = isolation_mode()
    rows = []
    for batched in (False, True):
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            outcomes = sandbox.run_batch(programs, batched=batched)
            best = min(best, time.perf_counter() - start)
            if not all(o.status == "ok" for program in outcomes for o in program):
                sys.exit(f"benchmark program failed: {outcomes[0]}")
        rows.append({"mode": "batched" if batched else "per_program", "isolation": mode,
                     "programs": args.programs, "cases_per_program": args.cases,
                     "seconds": round(best, 4), "programs_per_s": round(args.programs / best, 1)})
    out = sys.stdout if args.out == "-" else open(args.out, "w", newline="")
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    if out is not sys.stdout:
        out.close()


if __name__ == "__main__":
    main()
