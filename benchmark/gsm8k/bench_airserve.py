"""Few-shot GSM8K against a running airserve server (same flags as airserve.test.few_shot_gsm8k).

Usage:
    python -m airserve.launch_server --port 30000 &
    python benchmark/gsm8k/bench_airserve.py --num-questions 200 --result-file gsm8k.json
"""

from __future__ import annotations

import sys

from airserve.test.few_shot_gsm8k import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
