"""How long `scaffold new` and `scaffold upgrade` take, end to end per recipe.

Each is timed as a user runs it: a fresh `scaffold` process, including Python start-up, copier
rendering, black formatting and git. `new` ends with the first commit. `upgrade` takes a
project generated from an older template release (a copy of templates/ with one changed line,
published as 0.0.1 in this run's own HOME) to the installed version: copier renders both
versions and 3-way merges. Target: under 2 s.

    python bench/generate.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, bench_env, median, scratch

RECIPES = ("gpt2-baseline", "gpt2-speedup")


def timed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=REPO, capture_output=True)
    return time.perf_counter() - start


def older_projects(
    root: Path, recipe: str, count: int, env: dict[str, str]
) -> list[Path]:
    """`count` projects generated from release 0.0.1: today's templates with one line changed."""
    old = root / "old-templates"
    if not old.exists():
        shutil.copytree(REPO / "templates", old)
        train = old / "tasks" / "causal_lm" / "train.py.jinja"
        train.write_text(
            train.read_text().replace("    seed: int = 42", "    seed: int = 7", 1)
        )
    script = (
        "import sys; from pathlib import Path\n"
        "from scaffold.history import TemplateRelease\n"
        "from scaffold.render import new_project\n"
        "for dest in sys.argv[3:]:\n"
        "    new_project(sys.argv[2], Path(dest), [], release=TemplateRelease(Path(sys.argv[1]), '0.0.1'))\n"
    )
    projects = [root / f"{recipe}-old-{i}" for i in range(count)]
    subprocess.run(
        [sys.executable, "-c", script, str(old), recipe, *map(str, projects)],
        check=True,
        env=env,
        cwd=REPO,
        capture_output=True,
    )
    return projects


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = scratch()
    env = {
        **bench_env(),
        "HOME": str(root / "home"),
    }  # a private template-history cache
    scaffold = [sys.executable, "-m", "scaffold"]
    timed([*scaffold, "recipes"], env)  # warm the OS file cache
    timed(
        [*scaffold, "new", str(root / "warm"), "--recipe", RECIPES[0]], env
    )  # build the cache
    print(f"{'recipe':14} {'command':8} {'median s':>9} {'max s':>7}")
    worst = 0.0
    for recipe in RECIPES:
        times = [
            timed(
                [*scaffold, "new", str(root / f"{recipe}-{i}"), "--recipe", recipe], env
            )
            for i in range(args.repeats)
        ]
        worst = max(worst, median(times))
        print(
            f"{recipe:14} {'new':8} {median(times):9.2f} {max(times):7.2f}", flush=True
        )
        projects = older_projects(root, recipe, args.repeats, env)
        times = [
            timed([*scaffold, "upgrade", str(project)], env) for project in projects
        ]
        assert all(
            "seed: int = 42" in (p / "train.py").read_text() for p in projects
        ), "upgrade did nothing"
        worst = max(worst, median(times))
        print(
            f"{recipe:14} {'upgrade':8} {median(times):9.2f} {max(times):7.2f}",
            flush=True,
        )
    print(f"generate: slowest median = {worst:.2f} s (target < 2 s)")


if __name__ == "__main__":
    main()
