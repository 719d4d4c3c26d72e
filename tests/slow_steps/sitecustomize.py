"""Slow steps for the SLURM time-limit tests: every Python process whose PYTHONPATH holds this
folder imports it at start-up (Python's `sitecustomize` hook). With SCAFFOLD_TEST_STEP_SECONDS
set, each optimizer step of a generated train.py then sleeps that long after updating the
weights (a global optimizer-step hook), so a TINY run outlasts SLURM's shortest time limit (one
minute) without changing what it computes. A signal that arrives during the sleep is recorded
by the run's handler and acted on at the end of the step, as during a long real step.
"""

import os

SECONDS = float(os.environ.get("SCAFFOLD_TEST_STEP_SECONDS", "0"))

if SECONDS > 0:
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(
        lambda optimizer, args, kwargs: time.sleep(SECONDS)
    )
