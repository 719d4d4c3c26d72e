"""Runs a generated project's `train.main()` several times in one launch (torchrun is slow to start).

    torchrun ... tests/microbatch_driver.py PROJECT PLAN.json OUT_DIR

PLAN is a list of {"name", "inject" (SCAFFOLD_INJECT_OOM or ""), "args"}; every rank writes
OUT_DIR/<name>-rank<R>.json with the microbatch sizes it settled on, in order.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

project, plan_file, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
sys.path.insert(0, project)
import train  # noqa: E402  (the generated project's)

from runtime import dist, microbatch  # noqa: E402

settled: list[int] = []
_settle = microbatch.Search._settle


def _record(self: microbatch.Search, seq_len: int, proven: bool = True) -> None:
    _settle(self, seq_len, proven)
    settled.append(self.size)


microbatch.Search._settle = _record  # type: ignore[method-assign]
rank = int(os.environ.get("RANK", "0"))
try:
    for run in json.loads(plan_file.read_text()):
        os.environ.pop(microbatch.INJECT_ENV, None)
        if run["inject"]:
            os.environ[microbatch.INJECT_ENV] = run["inject"]
        settled.clear()
        sys.argv = ["train.py", *run["args"]]
        train.main()
        (out_dir / f"{run['name']}-rank{rank}.json").write_text(
            json.dumps({"settled": settled})
        )
finally:
    dist.shutdown()
