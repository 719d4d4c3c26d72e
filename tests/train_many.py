"""Run several generated `train.py` commands in one interpreter, one after another, so that
checks of runs that stop in setup (a bad flag, file or model: one line, exit 2) pay the
imports of torch and its libraries once instead of once a run.

    python train_many.py JOBS.json

JOBS.json is a list of [train.py, working folder, [args...], output prefix]. Each run sees
what `python train.py ARGS` in its folder would: its own sys.argv, working folder and fresh
project modules (train, model, data, sample), its stdout and stderr (file descriptors 1 and 2,
so output from C code too) in PREFIX.out and PREFIX.err, and its exit status in PREFIX.code
(SystemExit's, as the interpreter would turn it into one).
"""

import json
import os
import runpy
import sys
import traceback

PROJECT_MODULES = ("train", "model", "data", "sample")


def exit_status(code: object) -> int:
    """The status `python` exits with for `SystemExit(code)`, printing a message as it does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run(train: str, workdir: str, args: list[str]) -> int:
    project = os.path.dirname(os.path.abspath(train))
    for name in PROJECT_MODULES:
        sys.modules.pop(name, None)
    sys.path.insert(0, project)  # the project's modules, as python does
    os.chdir(workdir)
    sys.argv = [train, *args]
    try:
        runpy.run_path(train, run_name="__main__")
        return 0
    except SystemExit as stop:
        return exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.path.remove(project)


def main() -> None:
    with open(sys.argv[1]) as jobs_file:
        jobs = json.load(jobs_file)
    for train, workdir, args, prefix in jobs:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(f"{prefix}.out", "w") as out, open(f"{prefix}.err", "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                code = run(train, workdir, args)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
        with open(f"{prefix}.code", "w") as status:
            status.write(str(code))


main()
