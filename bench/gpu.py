"""The GPU check: the recipes' step on one CUDA device, each arm a fresh process, in one table.

Arms (in this order; `--budget` seconds in all, an arm that no longer fits is skipped and
says so): nanoGPT's training step (re-implemented in bench/overhead.py: its model, batches,
fused AdamW, TF32, bf16 autocast, whole-model torch.compile), the generated gpt2-baseline,
gpt2-speedup (every step at full length: `--seq_length_warmup_min_len=1024`), gpt2-modern,
gpt2-speedrun (GPT-2 124M, seq 1024, batch 32 in microbatches of 16, the stdlib bytes as
GPT-2 tokens), bert-pretrain-baseline and mosaicbert (bert-base, batch 256 x 128 in one
microbatch, the default corpus), all compiled (`--compile=true`) in bf16 autocast,
gpt2-baseline and gpt2-speedup again with the whole model as one graph (`--compile=model`),
bench/microbatch_cuda.py (the size `auto` finds against fixed ones), and float8 training
(torchao, bench/gpt2-float8.toml) against bf16: gpt2-float8 and gpt2-float8-rowwise beside
gpt2-baseline at GPT-2 124M, gpt2-xl-float8 beside gpt2-xl-bf16 at GPT-2 XL (1.5B, the
largest preset; microbatches of 8), compiled.

Per arm: ms/step and tokens/s (the median of metrics.jsonl's records after the first, each
the mean between two logged steps, which wait for the device; nanoGPT reads its loss every
step, so its own steps are timed), MFU (the run's own FLOPs formula against the device's
peak; nanoGPT's: 6N + 12 L H Q T per token), passes per step (forward calls of the whole
model with gradients, per optimizer step), host syncs per step (`torch.cuda.set_sync_debug_mode`
warnings over steps that do not log), recompilations and graph breaks (TORCH_LOGS), the peak
memory allocated, and a profiler summary of two steps (the top kernels by device time, device
busy time and kernels per step, and the CUDA calls that wait for the device). A run logs
every 10th step and is stopped after its profiled steps (no final evaluation or checkpoint).

    python bench/gpu.py --out DIR [--arms nanogpt,gpt2-baseline,...] [--budget 480]
    python bench/gpu.py --smoke --out DIR   # every arm on the CPU, tiny: checks the script

DIR gets results.json and results.md (the table, then each arm's profile and any failure's
output). Without CUDA (and without --smoke) it prints "skipped" and exits 0. With --smoke the
syncs are counted on the CPU by tests/host_syncs.py (what would wait for a GPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import bench_env, generate, scratch
from overhead import NANOGPT_LOOP, write_train_bin

REPO = Path(__file__).resolve().parent.parent
GPT = [
    "--model=gpt2",
    "--vocab_size=50304",
    "--seq_len=1024",
    "--global_batch_size=32",
    "--device_microbatch_size=16",
]
GPT_XL = [*GPT[1:4], "--model=gpt2-xl", "--device_microbatch_size=8"]
BERT = ["--model=bert-base", "--global_batch_size=256", "--device_microbatch_size=256"]
# The same runs at a size the CPU trains in seconds (--smoke).
GPT_SMOKE = [
    "--model=tiny",
    "--vocab_size=256",
    "--seq_len=64",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
]
BERT_SMOKE = [
    "--model=tiny",
    "--seq_len=32",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
    "--vocab_size=512",
]
# gpt2-baseline with the float8 algorithm (bench/gpt2-float8.toml).
FLOAT8 = "bench/gpt2-float8.toml"
# name: (recipe, settings on a GPU, settings in --smoke); recipe None: nanoGPT's loop.
# An arm's settings replace the defaults of generated_arm (e.g. "--compile=..."), so a
# variant of a recipe is one more line here.
ARMS = {
    "nanogpt": (None, [], []),
    "gpt2-baseline": ("gpt2-baseline", GPT, GPT_SMOKE),
    "gpt2-speedup": (
        "gpt2-speedup",
        [*GPT, "--seq_length_warmup_min_len=1024"],
        [*GPT_SMOKE, "--seq_length_warmup_min_len=64"],
    ),
    "gpt2-modern": ("gpt2-modern", GPT, GPT_SMOKE),
    "gpt2-speedrun": ("gpt2-speedrun", GPT, GPT_SMOKE),
    "bert-pretrain-baseline": ("bert-pretrain-baseline", BERT, BERT_SMOKE),
    "mosaicbert": ("mosaicbert", BERT, BERT_SMOKE),
    # The whole model as one graph (nanoGPT's form) against the regional compile above:
    # which `compile=auto` should pick on one GPU. In --smoke, eager like the others.
    "gpt2-baseline-whole-model": (
        "gpt2-baseline",
        [*GPT, "--compile=model"],
        GPT_SMOKE,
    ),
    "gpt2-speedup-whole-model": (
        "gpt2-speedup",
        [*GPT, "--seq_length_warmup_min_len=1024", "--compile=model"],
        [*GPT_SMOKE, "--seq_length_warmup_min_len=64"],
    ),
    "microbatch_cuda": ("microbatch_cuda", [], []),
    # Float8 training (torchao) against bf16 autocast, both compiled: GPT-2 124M (the
    # gpt2-baseline arm is its bf16 side), then the largest preset, GPT-2 XL (1.5B; 1600
    # wide: every linear a multiple of 16), in microbatches of 8. In --smoke, emulated.
    "gpt2-float8": (FLOAT8, GPT, [*GPT_SMOKE, "--float8_emulate=true"]),
    "gpt2-float8-rowwise": (
        FLOAT8,
        [*GPT, "--float8_recipe=rowwise"],
        [*GPT_SMOKE, "--float8_emulate=true", "--float8_recipe=rowwise"],
    ),
    "gpt2-xl-bf16": ("gpt2-baseline", GPT_XL, GPT_SMOKE),
    "gpt2-xl-float8": (FLOAT8, GPT_XL, [*GPT_SMOKE, "--float8_emulate=true"]),
}
ARM_SECONDS = 60  # a compiled arm's usual wall time: below this much budget, skipped


def windows(log_every: int) -> dict[str, int]:
    """Which steps each measurement covers: syncs from the end of step L + 1 to the end of
    step 2L (no log inside: logs come after steps L and 2L), the profiler from the end of
    step 3L + 1 over 2 steps; the run stops there."""
    return {
        "log_every": log_every,
        "sync_from": log_every + 1,
        "sync_until": 2 * log_every,
        "profile_from": 3 * log_every + 1,
        "profile_until": 3 * log_every + 3,
    }


# --------------------------------------------------------------------------- one arm, inside


def run_arm(spec: dict) -> None:
    """In the arm's own process: run the training script with the measurements hooked in,
    then write them to spec["result"] and exit at the end of the profiled steps."""
    import runpy
    import warnings

    import torch
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import register_optimizer_step_post_hook

    cuda = spec["device"] == "cuda"
    steps = windows(spec["log_every"])
    found = {"passes": [], "step_s": [], "syncs": 0, "sync_places": {}}
    places: collections.Counter[str] = collections.Counter()
    state = {"depth": 0, "passes": 0, "steps": 0, "last": time.perf_counter()}
    host_syncs = None
    if cuda:

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                places[f"{Path(filename).name}:{lineno}"] += 1

        warnings.showwarning = show
        warnings.simplefilter("always")
    else:  # the CPU: what would wait for a GPU (tests/host_syncs.py)
        sys.path.insert(0, str(REPO / "tests"))
        from host_syncs import HostSyncs

        host_syncs = HostSyncs().__enter__()

    def enter(module, args):
        if state["depth"] == 0 and torch.is_grad_enabled():
            state["passes"] += 1
        state["depth"] += 1

    def leave(module, args, output):
        state["depth"] -= 1

    def counting(on: bool) -> None:
        if cuda:
            torch.cuda.set_sync_debug_mode("warn" if on else "default")
        else:
            host_syncs.counting = on

    def step_done(optimizer, args, kwargs) -> None:
        if not state["passes"]:  # a second optimizer of the same step (Muon's AdamW)
            return
        now = time.perf_counter()
        found["passes"].append(state["passes"])
        found["step_s"].append(now - state["last"])
        state.update(passes=0, last=now, steps=state["steps"] + 1)
        step = state["steps"]
        if step == steps["sync_from"]:
            counting(True)
        elif step == steps["sync_until"]:
            counting(False)
            counted = list(places.elements()) if cuda else host_syncs.events
            found["syncs"] = len(counted) / (steps["sync_until"] - steps["sync_from"])
            found["sync_places"] = dict(collections.Counter(counted).most_common(6))
        elif step == steps["profile_from"]:
            state["profiler"] = start_profiler(cuda)
        elif step == steps["profile_until"]:
            if cuda:
                torch.cuda.synchronize()
            state["profiler"].stop()
            found["profile"] = profile_summary(state["profiler"], cuda, 2)
            finish(found, spec, cuda, namespace)

    register_module_forward_pre_hook(enter)
    register_module_forward_hook(leave, always_call=True)
    register_optimizer_step_post_hook(step_done)
    namespace = {"__name__": "__main__"}
    sys.argv = spec["argv"]
    os.chdir(spec["cwd"])
    if spec["script"] == "nanogpt":
        exec(compile(NANOGPT_LOOP, "nanogpt", "exec"), namespace)
    else:
        sys.path.insert(0, str(Path(spec["script"]).parent))
        namespace = runpy.run_path(spec["script"], run_name="__main__")
    finish(
        {**found, "error": "the run ended before its profiled steps"}, spec, cuda, {}
    )


def start_profiler(cuda: bool):
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.start()
    return profiler


def profile_summary(profiler, cuda: bool, steps: int) -> dict:
    """A few KB: the top operators by device (CPU: host) time, and per step the device's
    busy time, its kernels, and the CUDA calls that wait for it."""
    events = profiler.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    waits = {
        e.key: e.count / steps
        for e in events
        if e.key.startswith("cuda")
        and any(w in e.key for w in ("Synchronize", "Memcpy", "QueryEvent"))
        and "Async" not in e.key
    }
    kernels = [
        e for e in events if cuda and getattr(e, "device_type", None) is not None
    ]
    on_device = [e for e in kernels if str(e.device_type).endswith("CUDA")]
    return {
        "busy_ms_per_step": sum(getattr(e, key) for e in on_device) / 1000 / steps,
        "kernels_per_step": sum(e.count for e in on_device) / steps,
        "waiting_calls_per_step": waits,
        "table": events.table(sort_by=key, row_limit=12, max_name_column_width=60),
    }


def finish(found: dict, spec: dict, cuda: bool, namespace: dict) -> None:
    import torch

    if cuda:
        found["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        found["device_name"] = torch.cuda.get_device_name()
    else:
        import resource

        found["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        found["device_name"] = "cpu"
    model = namespace.get("model")
    if model is not None and spec["script"] == "nanogpt":
        found["params"] = sum(p.numel() for p in model.parameters())
    Path(spec["result"]).write_text(json.dumps(found))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------- the driver


def launch(spec: dict, timeout: float) -> tuple[dict, str]:
    """One arm in a fresh process: its findings, and its stderr."""
    env = {
        **bench_env(),
        "TORCH_LOGS": "recompiles,graph_breaks",
        "HF_HUB_OFFLINE": "1",
    }
    if spec["device"] == "cpu":  # --smoke: one thread each, quick on a busy machine
        env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, __file__, "--run-arm", json.dumps(spec)]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout
        )
        stderr = done.stderr
    except subprocess.TimeoutExpired as expired:
        stderr = expired.stderr or ""
        stderr = (
            stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
        )
        stderr += f"\n(timed out after {timeout:.0f} s)"
    result = Path(spec["result"])
    found = json.loads(result.read_text()) if result.exists() else {}
    if not found:
        found["error"] = "no result: " + (stderr.strip().splitlines() or ["?"])[-1]
    found["recompiles"] = stderr.count("Recompiling function")
    found["graph_breaks"] = stderr.count("Graph Break Reason")
    return found, stderr


def overridden(defaults: list[str], settings: list[str]) -> list[str]:
    """`defaults` with any option that `settings` (an arm's) also gives replaced by it:
    train.py takes each option once."""
    given = {setting.split("=")[0] for setting in settings}
    return [d for d in defaults if d.split("=")[0] not in given] + settings


def generated_arm(name, project, settings, root, data, args) -> tuple[dict, str]:
    steps = windows(args.log_every)
    run = root / "runs" / name
    defaults = [
        f"--device={args.device}",
        f"--run_name={name}",
        *([f"--data={data}"] if name.startswith("gpt2") else []),
        f"--precision={'amp_bf16' if args.device == 'cuda' else 'fp32'}",
        f"--compile={'true' if args.device == 'cuda' else 'false'}",
        "--max_duration=1000ba",
        f"--log_interval={args.log_every}ba",
        "--eval_interval=1000ba",
        "--save_interval=1000ba",
        "--eval_batches=1",
        "--autoresume=false",
    ]
    argv = [str(project / "train.py"), *overridden(defaults, settings)]
    spec = {
        **steps,
        "script": argv[0],
        "argv": argv,
        "cwd": str(root),
        "device": args.device,
        "result": str(root / f"{name}.json"),
    }
    found, stderr = launch(spec, args.timeout)
    metrics = run / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines()]
        if metrics.exists()
        else []
    )
    timed = [
        r
        for r in records[1:]
        if "step_ms" in r and r["step"] <= steps["sync_until"] + args.log_every
    ]
    if timed:
        found["ms_per_step"] = statistics.median(r["step_ms"] for r in timed)
        found["tokens_per_s"] = statistics.median(
            r.get("tokens_per_s", 0) for r in timed
        )
        mfu = [r["mfu"] for r in timed if "mfu" in r]
        found["mfu"] = statistics.median(mfu) if mfu else None
    return found, stderr


def nanogpt_arm(root, data, args) -> tuple[dict, str]:
    from runtime.monitor import peak_flops

    sizes, seq, batch, micro = (
        ("4,4,128", 64, 8, 4) if args.smoke else ("12,12,768", 1024, 32, 16)
    )
    compiled = "1" if args.device == "cuda" else "0"
    vocab = "256" if args.smoke else "50304"  # the data: the stdlib's bytes
    argv = [
        "nanogpt",
        str(data),
        sizes,
        str(seq),
        str(batch),
        str(micro),
        "1000",
        args.device,
        compiled,
        vocab,
    ]
    steps = windows(args.log_every)
    spec = {
        **steps,
        "script": "nanogpt",
        "argv": argv,
        "cwd": str(root),
        "device": args.device,
        "result": str(root / "nanogpt.json"),
    }
    found, stderr = launch(spec, args.timeout)
    timed = found.get("step_s", [])[
        args.log_every : steps["sync_until"] + args.log_every
    ]
    if timed:
        seconds = statistics.median(timed)
        found["ms_per_step"] = 1000 * seconds
        found["tokens_per_s"] = batch * seq / seconds
        layers, heads, width = map(int, sizes.split(","))
        per_token = (
            6 * found.get("params", 0) + 12 * layers * heads * (width // heads) * seq
        )
        peak = peak_flops(found.get("device_name", "cpu"), "amp_bf16")
        found["mfu"] = found["tokens_per_s"] * per_token / peak if peak else None
    return found, stderr


def microbatch_arm(args) -> tuple[dict, str]:
    command = [sys.executable, str(REPO / "bench" / "microbatch_cuda.py"), "--steps=15"]
    done = subprocess.run(
        command, env=bench_env(), capture_output=True, text=True, timeout=args.timeout
    )
    lines = done.stdout.strip().splitlines()
    found = {"summary": lines[-4:] if lines else [], "rc": done.returncode}
    if done.returncode:
        found["error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
    return found, done.stderr


def table(results: dict[str, dict]) -> list[str]:
    def cell(value, form):
        return "-" if value is None else form.format(value)

    rows = [
        "| arm | ms/step | tokens/s | MFU | passes/step | syncs/step | recompiles | graph breaks | peak GB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, found in results.items():
        if "summary" in found or "skipped" in found or "error" in found:
            note = (
                found.get("skipped")
                or found.get("error")
                or "; ".join(found["summary"])
            )
            rows.append(f"| {name} | {note} | | | | | | | |")
            continue
        passes = found.get("passes", [])
        rows.append(
            "| "
            + " | ".join(
                [
                    name,
                    cell(found.get("ms_per_step"), "{:.1f}"),
                    cell(found.get("tokens_per_s"), "{:,.0f}"),
                    cell(found.get("mfu") and 100 * found["mfu"], "{:.1f}%"),
                    cell(statistics.median(passes) if passes else None, "{:g}"),
                    cell(found.get("syncs"), "{:.2f}"),
                    str(found.get("recompiles", "-")),
                    str(found.get("graph_breaks", "-")),
                    cell(found.get("peak_gb"), "{:.2f}"),
                ]
            )
            + " |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpu-check"),
        help="folder for results.json and results.md",
    )
    parser.add_argument(
        "--arms",
        default=",".join(ARMS),
        help="comma-separated, from: " + ", ".join(ARMS),
    )
    parser.add_argument(
        "--budget", type=float, default=480, help="seconds for all arms"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="every arm on the CPU, tiny"
    )
    parser.add_argument("--run-arm", help=argparse.SUPPRESS)  # inside an arm's process
    args = parser.parse_args()
    if args.run_arm:
        run_arm(json.loads(args.run_arm))
        return
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("skipped: no CUDA device on this machine")
        return
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(
            f"unknown arm(s) {', '.join(sorted(unknown))}; pick from {', '.join(ARMS)}"
        )
    args.device = "cpu" if args.smoke else "cuda"
    args.log_every = 3 if args.smoke else 10
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget
    root = scratch()
    names = args.arms.split(",")
    recipes = {ARMS[n][0] for n in names} - {None, "microbatch_cuda"}
    projects = {
        recipe: generate(recipe, root) for recipe in sorted(recipes | {"gpt2-baseline"})
    }
    data = write_train_bin(projects["gpt2-baseline"], root)
    device = (
        torch.cuda.get_device_name()
        if args.device == "cuda"
        else "cpu (smoke: tiny sizes, no compile)"
    )
    header = f"device: {device}; torch {torch.__version__}; load {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}"
    print(header, flush=True)
    results, details = {}, []
    for name in names:
        left = deadline - time.perf_counter()
        if left < ARM_SECONDS and not args.smoke:
            results[name] = {"skipped": f"skipped: {left:.0f} s of the budget left"}
            continue
        args.timeout = max(ARM_SECONDS, left) if not args.smoke else 600
        recipe, settings, smoke_settings = ARMS[name]
        started = time.perf_counter()
        if recipe is None:
            found, stderr = nanogpt_arm(root, data, args)
        elif recipe == "microbatch_cuda":
            found, stderr = microbatch_arm(args)
        else:
            chosen = smoke_settings if args.smoke else settings
            found, stderr = generated_arm(
                name, projects[recipe], chosen, root, data, args
            )
        found["wall_s"] = time.perf_counter() - started
        results[name] = found
        print(table({name: found})[-1], f"({found['wall_s']:.0f} s)", flush=True)
        profile = found.get("profile")
        if profile:
            waits = (
                ", ".join(
                    f"{k} {v:g}" for k, v in profile["waiting_calls_per_step"].items()
                )
                or "none"
            )
            details += [
                f"### {name}",
                "",
                f"device busy {profile['busy_ms_per_step']:.1f} ms/step, {profile['kernels_per_step']:.0f} kernels/step; "
                f"CUDA calls that wait, per step: {waits}; syncs counted at: {found.get('sync_places') or 'none'}",
                "",
                "```",
                profile["table"],
                "```",
                "",
            ]
        if "error" in found:
            tail = "\n".join(stderr.strip().splitlines()[-30:])
            details += [f"### {name}: failed", "", "```", tail, "```", ""]
    lines = [header, "", *table(results), "", *details]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    for found in results.values():
        found.pop("step_s", None)
        if "profile" in found:
            found["profile"].pop("table", None)
    (args.out / "results.json").write_text(
        json.dumps({"header": header, "arms": results}, indent=1)
    )
    print("\n".join(table(results)))
    print(f"written: {args.out / 'results.md'}, {args.out / 'results.json'}")
    failed = [n for n, f in results.items() if "error" in f]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see results.md)")


if __name__ == "__main__":
    main()
