"""How long `scaffold new` (and `scaffold upgrade`, when available) take, end to end per recipe.

Each is timed as a user runs it: a fresh `scaffold` process, including Python start-up, copier
rendering, black formatting and the first git commit. Target: under 2 s.

    python bench/generate.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from _common import REPO, bench_env, median, scratch

RECIPES = ("gpt2-baseline", "gpt2-speedup")


def timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, env=bench_env(), cwd=REPO, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = scratch()
    scaffold = [sys.executable, "-m", "scaffold"]
    timed([*scaffold, "recipes"])  # warm the OS file cache and the template-history cache
    print(f"{'recipe':14} {'command':8} {'median s':>9} {'max s':>7}")
    worst = 0.0
    for recipe in RECIPES:
        times = [timed([*scaffold, "new", str(root / f"{recipe}-{i}"), "--recipe", recipe]) for i in range(args.repeats)]
        worst = max(worst, median(times))
        print(f"{recipe:14} {'new':8} {median(times):9.2f} {max(times):7.2f}")
        upgrade_help = subprocess.run([*scaffold, "upgrade", "--help"], env=bench_env(), cwd=REPO, capture_output=True)
        if upgrade_help.returncode == 0:
            times = [timed([*scaffold, "upgrade", str(root / f"{recipe}-{i}")]) for i in range(args.repeats)]
            worst = max(worst, median(times))
            print(f"{recipe:14} {'upgrade':8} {median(times):9.2f} {max(times):7.2f}")
    print(f"generate: slowest median = {worst:.2f} s (target < 2 s)")


if __name__ == "__main__":
    main()
