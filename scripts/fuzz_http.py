"""Fuzz the generation endpoints for longer than the test suite does.

    python scripts/fuzz_http.py --examples 3000 [--seed 1234]

Runs the random cases of test/srt/entrypoints/test_http_fuzz.py (a live server on a tiny random
model) with `--examples` cases per endpoint and a random (or given) hypothesis seed; the seed
is printed so a failure can be replayed. Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST = os.path.join(ROOT, "test", "srt", "entrypoints", "test_http_fuzz.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=1000, help="cases per endpoint")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (random)")
    parser.add_argument("--endpoint", choices=("generate", "completions", "chat"),
                        help="fuzz only this endpoint")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"fuzzing with {args.examples} cases per endpoint, --seed {seed}", flush=True)
    selected = "fuzzed_requests" + (f" and {args.endpoint}" if args.endpoint else "")
    cmd = [sys.executable, "-m", "pytest", TEST, "-q", "-x", f"--hypothesis-seed={seed}",
           "-k", selected]
    env = {**os.environ, "AIRSERVE_FUZZ_EXAMPLES": str(args.examples)}
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
