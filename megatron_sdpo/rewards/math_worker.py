"""Worker process for math-verify (run as a script by megatron_sdpo.rewards.math).

sympy can hang in C code (``9^{9^{9}}``) where no signal-based timeout reaches it, so the trainer
keeps math-verify in this separate process and kills it on a deadline. Protocol: one JSON object
per line on stdin, a batch {"items": [[gold, answer], ...]}; one line per item on stdout, in
order and flushed as each is done ({"correct": bool, "parsed": str, "error": str | null}), so the
parent holds every answer to its own deadline. A first line {"ready": true} announces that the
imports are done.
"""

import json
import os
import signal
import sys
import warnings


def end_with(parent: int) -> None:
    """As stop_request.serve_parent (this isolated script imports nothing of the package): the
    stop signals are the rank's, which kills this worker when it no longer needs it; and the
    worker dies with the rank however the rank dies, instead of living on under init."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(0)


def main() -> None:
    if len(sys.argv) > 1:
        end_with(int(sys.argv[1]))
    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)  # math-verify warns about disabled timeouts on every call
    from math_verify import parse, verify

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    gold_cache: dict = {}
    for line in sys.stdin:
        for gold, answer in json.loads(line)["items"]:
            try:
                if gold not in gold_cache:
                    gold_cache[gold] = parse(f"${gold}$", parsing_timeout=None)
                parsed_answer = parse(f"${answer}$", parsing_timeout=None)
                correct = bool(parsed_answer) and verify(gold_cache[gold], parsed_answer, timeout_seconds=None)
                parsed = str(parsed_answer[0]) if parsed_answer else ""
                reply = {"correct": bool(correct), "parsed": parsed[:200], "error": None}
            except Exception as exc:  # a malformed answer is a wrong answer, not a worker crash
                reply = {"correct": False, "parsed": "", "error": f"{type(exc).__name__}: {exc}"[:200]}
            out.write(json.dumps(reply) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
