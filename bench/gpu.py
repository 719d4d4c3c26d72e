"""GPU throughput: GPT-2 124M at sequence length 1024 in bf16, generated loops against nanoGPT.

On one CUDA device, in one invocation, each run in a fresh process:
- the generated `gpt2-baseline` and `gpt2-speedup` (ALiBi through FlexAttention, sequence-length
  warmup), each with `--compile=true` and `--compile=false`, and with `--whole-model` also
  `--compile=model` (the whole model as one graph, as nanoGPT compiles it, against `true`'s
  compiled blocks: which of the two `auto` should pick on one GPU);
- nanoGPT's training step as re-implemented in bench/overhead.py (its model, get_batch, fused
  AdamW, TF32, bf16 autocast), with and without its whole-model `torch.compile`.
Same data (the stdlib bytes as a uint16 train.bin, vocabulary 50,304 as nanoGPT's GPT-2),
batch, microbatch and steps. Reported: median step time after warmup (for gpt2-speedup only
the steps at full length), tokens/s and MFU (nanoGPT's estimate: 6N + 12 L H Q T FLOPs per
token against the device's dense bf16 peak).

Targets (issue 17): generated >= 1.0x nanoGPT's tokens/s; baseline MFU >= 50% on an H100;
gpt2-speedup's per-token step time within 5% of the baseline's at full length.

    python bench/gpu.py [--steps 40] [--batch 32] [--micro 16] [--compile both|on|off]
                        [--whole-model]

Without CUDA it prints "skipped" and exits 0. `--smoke` runs the same script on the CPU with the
tiny preset, a short sequence and compilation off (a check that the bench itself works, no
numbers worth reporting).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from _common import bench_env, generate, median, scratch
from overhead import NANOGPT_LOOP, write_train_bin

WARMUP_STEPS = 10
COMPILE_LABELS = {True: "on", False: "off", "model": "model"}  # --compile= values
SEQ_LEN = 1024
VOCAB = 50304
PRESET, (N_LAYER, N_HEAD, N_EMBD) = "gpt2", (12, 12, 768)  # as model.py's PRESETS
DEVICE = "cuda"
# Dense bf16 tensor-core peaks, FLOP/s (vendor data sheets; SXM parts).
PEAK_BF16 = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10": 125e12,
}


def peak_flops(device_name: str) -> float | None:
    for key, value in PEAK_BF16.items():
        if key in device_name:
            return value
    return None


def flops_per_token(num_params: int) -> float:
    """nanoGPT's estimate_mfu: 6N for the matmuls plus 12 L H Q T for attention."""
    return 6 * num_params + 12 * N_LAYER * N_HEAD * (N_EMBD // N_HEAD) * SEQ_LEN


def generated_run(
    project: Path, workdir: Path, name: str, data: Path, compile_: bool | str, args
) -> tuple[float, int]:
    """(median ms per full-length step, parameters) of the generated train.py."""
    steps = args.steps
    command = [
        sys.executable,
        str(project / "train.py"),
        f"--device={DEVICE}",
        f"--run_name={name}",
        f"--data={data}",
        f"--vocab_size={VOCAB}",
        f"--model={PRESET}",
        f"--seq_len={SEQ_LEN}",
        f"--global_batch_size={args.batch}",
        f"--device_microbatch_size={args.micro}",
        f"--precision={'amp_bf16' if DEVICE == 'cuda' else 'fp32'}",
        f"--compile={str(compile_).lower()}",
        f"--max_duration={steps}ba",
        f"--eval_interval={steps}ba",
        f"--save_interval={steps}ba",
        "--eval_batches=1",
        "--autoresume=false",
    ]
    result = subprocess.run(
        command, cwd=workdir, env=bench_env(), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    run_dir = workdir / "runs" / name
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    full = [
        r
        for r in records[WARMUP_STEPS:]
        if r.get("seq_len", SEQ_LEN) == SEQ_LEN and "step_ms" in r
    ]
    log = (run_dir / "log.txt").read_text()
    params = int(log.split(" parameters")[0].rsplit(" ", 1)[1].replace(",", ""))
    return median([r["step_ms"] for r in full]), params


def nanogpt_run(data: Path, compile_: bool, args) -> tuple[float, int]:
    command = [
        sys.executable,
        "-c",
        NANOGPT_LOOP,
        str(data),
        f"{N_LAYER},{N_HEAD},{N_EMBD}",
        str(SEQ_LEN),
        str(args.batch),
        str(args.micro),
        str(args.steps),
        DEVICE,
        "1" if compile_ else "0",
        str(VOCAB),
    ]
    result = subprocess.run(command, env=bench_env(), capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nanoGPT loop failed:\n{result.stderr[-3000:]}")
    times, params = (json.loads(line) for line in result.stdout.splitlines()[:2])
    return 1000 * median(times[WARMUP_STEPS:]), params


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=40, help="steps per run (speedup: 30%% are warmup)"
    )
    parser.add_argument(
        "--batch", type=int, default=32, help="global batch (sequences)"
    )
    parser.add_argument("--micro", type=int, default=16, help="microbatch (sequences)")
    parser.add_argument(
        "--compile",
        choices=("both", "on", "off"),
        default="both",
        help="which torch.compile settings to run (on: the CUDA default; both: the "
        "compile-off runs too, as a check of the eager path)",
    )
    parser.add_argument(
        "--whole-model",
        action="store_true",
        help="the generated loops with --compile=model too (the whole model as one graph)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny, on the CPU, compile off"
    )
    args = parser.parse_args()
    import torch  # after argparse: --help works anywhere

    global WARMUP_STEPS, SEQ_LEN, PRESET, N_LAYER, N_HEAD, N_EMBD, DEVICE
    compile_options = {"both": (True, False), "on": (True,), "off": (False,)}[
        args.compile
    ]
    if args.smoke:
        WARMUP_STEPS, SEQ_LEN, PRESET, (N_LAYER, N_HEAD, N_EMBD), DEVICE = (
            2,
            64,
            "tiny",
            (4, 4, 128),
            "cpu",
        )
        args.steps, args.batch, args.micro, compile_options = 12, 4, 2, (False,)
    elif not torch.cuda.is_available():
        print("skipped: no CUDA device on this machine")
        return
    device_name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (smoke)"
    peak = peak_flops(device_name)
    root = scratch()
    projects = {
        recipe: generate(recipe, root) for recipe in ("gpt2-baseline", "gpt2-speedup")
    }
    data = write_train_bin(projects["gpt2-baseline"], root)
    tokens_per_step = args.batch * SEQ_LEN
    print(
        f"device: {device_name}; torch {torch.__version__}; {PRESET}, seq {SEQ_LEN}, bf16 autocast on CUDA, "
        f"batch {args.batch} x microbatch {args.micro}, {args.steps} steps (median after {WARMUP_STEPS})"
    )
    print(f"{'loop':28} {'ms/step':>9} {'tokens/s':>10} {'MFU':>6}")
    results = {}
    generated_options = (*compile_options, *(("model",) if args.whole_model else ()))
    runs = [("nanoGPT", c, None) for c in compile_options] + [
        (recipe, c, project)
        for recipe, project in projects.items()
        for c in generated_options
    ]
    for label, compile_, project in runs:
        name = f"{label} compile={COMPILE_LABELS[compile_]}"
        if project is None:
            ms, params = nanogpt_run(data, compile_, args)
        else:
            ms, params = generated_run(
                project,
                root,
                name.replace(" ", "_").replace("=", "-"),
                data,
                compile_,
                args,
            )
        tokens_per_s = tokens_per_step / (ms / 1000)
        mfu = tokens_per_s * flops_per_token(params) / peak if peak else float("nan")
        results[name] = (ms, tokens_per_s, mfu)
        print(f"{name:28} {ms:9.1f} {tokens_per_s:10.0f} {100 * mfu:5.1f}%", flush=True)
    on = "on" if True in compile_options else "off"
    base, speed, nano = (
        results[f"{k} compile={on}"]
        for k in ("gpt2-baseline", "gpt2-speedup", "nanoGPT")
    )
    print(
        f"generated/nanoGPT tokens/s (compile {on}): baseline {base[1] / nano[1]:.3f}, "
        f"speedup {speed[1] / nano[1]:.3f}; baseline MFU {100 * base[2]:.1f}%; "
        f"speedup/baseline step time at full length {speed[0] / base[0]:.3f}"
    )


if __name__ == "__main__":
    main()
