"""Loop overhead: the generated gpt2-baseline loop against a minimal hand-written PyTorch loop
and against nanoGPT's own train.py.

All do the same work: the same model sizes, data, batch, microbatches (gradient accumulation),
precision (fp32), AdamW hyperparameters, gradient clipping and LR schedule, and the same
allocator settings. The generated loop runs as shipped (progress, metrics.jsonl and log every
step), with evaluation and checkpoints out of the timed steps; the hand-written loop trains the
generated model with the generated loop's optimizer and nothing else.

The nanoGPT column runs nanoGPT's own train.py as a user would (`--nanogpt` names a checkout of
github.com/karpathy/nanoGPT: its train.py, model.py and configurator.py are copied beside the
stdlib bytes written as its dataset, train.bin + val.bin + meta.pkl of vocabulary 256), with
the same sizes (bias on, as the generated model has), dropout 0, `--compile=False`, and its own
per-iteration times ("iter N: ... time T ms"). Without `--nanogpt` the column is nanoGPT's
step re-implemented in this file (NANOGPT_LOOP, which bench/gpu.py also runs where no
checkout can be carried). nanoGPT's model computes one function otherwise than GPT-2's: its
GELU is the exact one (erf), the generated model's GPT-2's tanh approximation (what GPT-2's
weights were trained with: `--init_from` and the export keep it), which costs the CPU more.
So the generated loop also runs on a copy of the project whose model.py has nanoGPT's GELU
(column "generated, erf"): that against nanoGPT compares the loops on the same model.

Where Lightning is installed (optional), its Trainer runs the same work as a fourth column.
Runs alternate A B C ... in one invocation; each reports its median step time after warmup.
`--clock cpu` (the default; `--clock wall` the wall clock) times every column in its process's CPU seconds with torch on one thread (the
generated loop's monitor and nanoGPT's `time.time()` read the process clock): on a machine
shared with other jobs, wall time measures the waiting for a core, CPU time the work.

    python bench/overhead.py [--rounds 3] [--steps 60] [--nanogpt ~/nanoGPT] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from _common import (
    ALLOCATOR,
    add_clock,
    apply_clock,
    bench_env,
    generate,
    median,
    scratch,
    train,
)

WARMUP_STEPS = 5

# The hand-written reference: nanoGPT-style, nothing but the work.
RAW_LOOP = r"""
import json, math, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from data import Batches, load_tokens
from model import GPT, GPTConfig, PRESETS
preset, seq_len, batch_size, micro, steps = sys.argv[2], *map(int, sys.argv[3:7])
lr_peak, warmup = 2e-3, 0.05
torch.manual_seed(42)
tokens = load_tokens("")
batches = Batches(tokens.train, seq_len, batch_size, seed=42)
model = GPT(GPTConfig(vocab_size=256, max_seq_len=seq_len, **PRESETS[preset]))
params = list(model.parameters())
optimizer = torch.optim.AdamW(
    [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
     {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
    lr=lr_peak, betas=(0.9, 0.95), fused=True)  # as the generated loop's
times = []
for step in range(steps):
    start = time.perf_counter()
    batch = batches.get(0, step)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    frac = step / steps
    lr = lr_peak * frac / warmup if frac < warmup else 0.1 * lr_peak + 0.45 * lr_peak * (
        1 + math.cos(math.pi * (frac - warmup) / (1 - warmup)))
    for group in optimizer.param_groups:
        group["lr"] = lr
    num_tokens = targets.numel()
    loss_sum = torch.zeros(())
    for x, y in zip(inputs.split(micro), targets.split(micro)):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
        (loss / num_tokens).backward()
        loss_sum += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss_sum.item()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


# nanoGPT's train.py step (karpathy/nanoGPT, model.py + train.py), re-implemented for this bench:
# the same module structure and arithmetic, without the parts that do not run here (DDP, the
# fp16 GradScaler, which is a no-op for fp32, evaluation, checkpoints). Bias on, as in nanoGPT's
# GPTConfig default, so the parameter count equals the generated model's.
NANOGPT_LOOP = r"""
import json, math, sys, time
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
data_path, (n_layer, n_head, n_embd) = sys.argv[1], map(int, sys.argv[2].split(","))
block_size, total_batch, batch_size, max_iters = map(int, sys.argv[3:7])
learning_rate, min_lr, warmup_iters, weight_decay, grad_clip = 2e-3, 2e-4, max(1, max_iters // 20), 0.1, 1.0
gradient_accumulation_steps = total_batch // batch_size
# bench/gpu.py adds: device, compile (0/1), vocabulary size (bf16 autocast and TF32 on CUDA).
device, compile, vocab_size = (sys.argv[7:10] + ["cpu", "0", "256"][len(sys.argv[7:10]):])
compile, vocab_size, dropout, bias = compile == "1", int(vocab_size), 0.0, True
device_type = "cuda" if "cuda" in device else "cpu"
torch.backends.cuda.matmul.allow_tf32 = True
ctx = torch.autocast(device_type, torch.bfloat16, enabled=device_type == "cuda")

class LayerNorm(nn.Module):
    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None
    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)

class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)
    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)
    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(n_embd, bias), CausalSelfAttention()
        self.ln_2, self.mlp = LayerNorm(n_embd, bias), MLP()
    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout), h=nn.ModuleList([Block() for _ in range(n_layer)]),
            ln_f=LayerNorm(n_embd, bias)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
    def forward(self, idx, targets):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss
    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), fused=device_type == "cuda")

def get_batch():
    data = np.memmap(data_path, dtype=np.uint16, mode="r")  # recreated every call, as nanoGPT does
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y

def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = (it - warmup_iters) / (max_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)

torch.manual_seed(1337)
model = GPT().to(device)
optimizer = model.configure_optimizers()
if compile:
    model = torch.compile(model)
X, Y = get_batch()
times = []
for iter_num in range(max_iters):
    t0 = time.perf_counter()
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch()  # the next batch, fetched while (on a GPU) the forward runs
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    lossf = loss.item() * gradient_accumulation_steps  # waits for the GPU: honest timing
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
print(json.dumps(sum(p.numel() for p in model.parameters())))
"""


# The same work under Lightning's Trainer (when installed): a dataloader of microbatches,
# accumulate_grad_batches for accumulation, gradient_clip_val for clipping, the same schedule.
LIGHTNING_LOOP = r"""
import json, math, sys, time
import torch, torch.nn.functional as F
import lightning as L
sys.path.insert(0, sys.argv[1])
from data import Batches, load_tokens
from model import GPT, GPTConfig, PRESETS
preset, seq_len, batch_size, micro, steps = sys.argv[2], *map(int, sys.argv[3:7])
lr_peak, warmup = 2e-3, 0.05
torch.manual_seed(42)
tokens = load_tokens("")
batches = Batches(tokens.train, seq_len, batch_size, seed=42)

class Microbatches(torch.utils.data.IterableDataset):
    def __iter__(self):
        for step in range(steps):
            yield from batches.get(0, step).split(micro)

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT(GPTConfig(vocab_size=256, max_seq_len=seq_len, **PRESETS[preset]))
        self.times = []
    def training_step(self, batch, index):
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("loss", loss)
        return loss
    def configure_optimizers(self):
        params = list(self.model.parameters())
        optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=lr_peak, betas=(0.9, 0.95))
        def factor(step):
            frac = step / steps
            return frac / warmup if frac < warmup else 0.1 + 0.45 * (1 + math.cos(math.pi * (frac - warmup) / (1 - warmup)))
        return [optimizer], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}]
    def on_train_batch_end(self, outputs, batch, index):
        if (index + 1) % (batch_size // micro) == 0:
            self.times.append(time.perf_counter())

module = Module()
trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, accumulate_grad_batches=batch_size // micro,
                    gradient_clip_val=1.0, enable_checkpointing=False, logger=False, enable_model_summary=False)
trainer.fit(module, torch.utils.data.DataLoader(Microbatches(), batch_size=None))
print(json.dumps([b - a for a, b in zip(module.times, module.times[1:])]))
"""


# Prepended to a timed process under --clock cpu: its clocks read the process's CPU time.
CPU_CLOCK = "import time\ntime.perf_counter = time.time = time.process_time\n"
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")
NANOGPT_ITER = re.compile(r"^iter (\d+): loss [-\d.naif]+, time ([\d.]+)ms", re.M)
# (layers, heads, width), as model.py's PRESETS
PRESET_SIZES = {"tiny": (4, 4, 128), "small": (6, 6, 384)}


def timed_env(cpu_clock: bool) -> dict[str, str]:
    """The benches' environment; under --clock cpu torch on one thread."""
    return {**bench_env(), **({"OMP_NUM_THREADS": "1"} if cpu_clock else {})}


def inline_ms(code: str, args: list[str], cpu_clock: bool, line: int = -1) -> float:
    """Median ms per step after warmup of an inline loop printing its step times (JSON)."""
    result = subprocess.run(
        [sys.executable, "-c", (CPU_CLOCK if cpu_clock else "") + code, *args],
        env=timed_env(cpu_clock),
        capture_output=True,
        text=True,
        check=True,
    )
    times = json.loads(result.stdout.strip().splitlines()[line])
    return 1000 * median(times[WARMUP_STEPS:])


def lightning_step_ms(project: Path, sizes: tuple, cpu_clock: bool) -> float:
    return inline_ms(LIGHTNING_LOOP, [str(project), *map(str, sizes)], cpu_clock)


def raw_step_ms(project: Path, sizes: tuple, cpu_clock: bool) -> float:
    return inline_ms(RAW_LOOP, [str(project), *map(str, sizes)], cpu_clock)


def reimplemented_nanogpt_step_ms(data: Path, sizes: tuple, cpu_clock: bool) -> float:
    """NANOGPT_LOOP, nanoGPT's step as re-implemented here."""
    preset, *numbers = sizes
    layout = ",".join(map(str, PRESET_SIZES[preset]))
    args = [str(data), layout, *map(str, numbers)]
    return inline_ms(NANOGPT_LOOP, args, cpu_clock, line=0)


def nanogpt_folder(checkout: Path, root: Path, train_bin: Path) -> Path:
    """nanoGPT's scripts copied from `checkout`, with the stdlib bytes as its dataset
    `stdlib`: train.bin (the generated project's training tokens), val.bin and a meta.pkl
    of vocabulary 256 (bytes), as nanoGPT's prepare.py scripts write them."""
    missing = [name for name in NANOGPT_FILES if not (checkout / name).is_file()]
    if missing:
        sys.exit(
            f"--nanogpt={checkout}: no {', '.join(missing)}; pass a checkout of "
            "github.com/karpathy/nanoGPT"
        )
    folder = root / "nanogpt"
    data = folder / "data" / "stdlib"
    data.mkdir(parents=True)
    for name in NANOGPT_FILES:
        shutil.copy(checkout / name, folder / name)
    shutil.copy(train_bin, data / "train.bin")
    shutil.copy(train_bin, data / "val.bin")  # evaluated once, at iteration 0
    with open(data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 256}, f)
    return folder


def nanogpt_step_ms(folder: Path, sizes: tuple, cpu_clock: bool) -> float:
    """nanoGPT's own train.py on the CPU: the median of the per-iteration times it prints,
    after warmup (iteration 0 includes its first evaluation, of one batch)."""
    preset, seq_len, batch, micro, steps = sizes
    n_layer, n_head, n_embd = PRESET_SIZES[preset]
    options = dict(
        dataset="stdlib",
        out_dir=folder / "out",
        device="cpu",
        compile=False,
        dtype="float32",  # the CPU's: nanoGPT's autocast context is off on the CPU
        n_layer=n_layer,
        n_head=n_head,
        n_embd=n_embd,
        bias=True,  # the generated model's biases (nanoGPT's default is none)
        dropout=0.0,
        block_size=seq_len,
        batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        learning_rate=2e-3,  # the generated gpt2-baseline's, as RAW_LOOP's
        min_lr=2e-4,
        warmup_iters=max(1, steps // 20),
        max_iters=steps,
        lr_decay_iters=steps,
        eval_interval=steps + 1,  # iteration 0 only
        eval_iters=1,
        log_interval=1,
        always_save_checkpoint=False,
    )
    command = [f"--{key}={value}" for key, value in options.items()]
    if cpu_clock:  # the same script, its time.time() reading the process's CPU time
        runner = "import runpy, sys\nsys.argv = sys.argv[1:]\n"
        runner += "runpy.run_path('train.py', run_name='__main__')\n"
        command = ["-c", CPU_CLOCK + runner, "train.py", *command]
    else:
        command = ["train.py", *command]
    result = subprocess.run(
        [sys.executable, *command],
        cwd=folder,
        env=timed_env(cpu_clock),
        capture_output=True,
        text=True,
        check=True,
    )
    times = [float(ms) for _, ms in NANOGPT_ITER.findall(result.stdout)]
    return median(times[WARMUP_STEPS:])


def write_train_bin(project: Path, root: Path) -> Path:
    """The default data (stdlib source bytes) as nanoGPT's uint16 train.bin."""
    sys.path.insert(0, str(project))
    from data import load_tokens  # the generated project's data.py

    path = root / "train.bin"
    load_tokens("").train.astype(np.uint16).tofile(path)
    return path


def generated_step_ms(
    project: Path, workdir: Path, run: str, sizes: tuple, cpu_clock: bool
) -> float:
    preset, seq_len, batch, micro, steps = sizes
    records = train(
        project,
        workdir,
        run,
        f"--model={preset}",
        f"--seq_len={seq_len}",
        f"--global_batch_size={batch}",
        f"--device_microbatch_size={micro}",
        f"--max_duration={steps}ba",
        f"--eval_interval={steps}ba",
        f"--save_interval={steps}ba",
        "--eval_batches=1",
        "--autoresume=false",
        cpu_clock=cpu_clock,
    )
    return median([r["step_ms"] for r in records][WARMUP_STEPS:])


def exact_gelu_copy(project: Path, root: Path) -> Path:
    """A copy of the generated project whose MLP applies nanoGPT's exact GELU."""
    copy = root / f"{project.name}-erf"
    shutil.copytree(project, copy)
    model = copy / "model.py"
    text = model.read_text()
    tanh = 'F.gelu(h, approximate="tanh")'
    if text.count(tanh) != 1:
        sys.exit(f"{model}: no single `{tanh}` to replace; update exact_gelu_copy")
    model.write_text(text.replace(tanh, "F.gelu(h)"))
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs per size")
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="steps per run (tiny); the larger size runs a third",
    )
    parser.add_argument(
        "--nanogpt",
        type=Path,
        help="a checkout of github.com/karpathy/nanoGPT: its own train.py is timed "
        "(else its step as re-implemented here)",
    )
    add_clock(parser)
    args = parser.parse_args()
    apply_clock(args.clock)
    cpu_clock = args.clock == "cpu"
    root = scratch()
    project = generate("gpt2-baseline", root)
    erf_project = exact_gelu_copy(project, root)
    sizes = {
        # (preset, seq_len, global batch, microbatch, steps): per-step overhead dominates ...
        "tiny": ("tiny", 128, 16, 8, args.steps),
        # ... and compute dominates.
        "larger": ("small", 256, 8, 4, max(WARMUP_STEPS + 5, args.steps // 3)),
    }
    clock = "CPU time, 1 thread" if cpu_clock else "wall time, default threads"
    print(f"allocator: {' '.join(f'{k}={v}' for k, v in ALLOCATOR.items())}; {clock}")
    with_lightning = (
        importlib.util.find_spec("lightning") is not None
    )  # optional, never required
    train_bin = write_train_bin(project, root)
    if args.nanogpt:
        folder = nanogpt_folder(args.nanogpt.expanduser(), root, train_bin)
        print(f"nanoGPT: its own train.py, from {args.nanogpt}")
    else:
        print("nanoGPT: its step as re-implemented here (--nanogpt: its own train.py)")

    def nano_ms(shape: tuple) -> float:
        if args.nanogpt:
            return nanogpt_step_ms(folder, shape, cpu_clock)
        return reimplemented_nanogpt_step_ms(train_bin, shape, cpu_clock)

    columns = ["raw", "generated", "generated, erf", "nanoGPT"]
    columns += ["lightning"] if with_lightning else []
    print(
        f"{'size':8} {'round':>5} "
        + " ".join(f"{name + ' ms':>17}" for name in columns)
        + "  load (1 min)"
    )
    summary = []
    for size, shape in sizes.items():
        times: dict[str, list[float]] = {name: [] for name in columns}
        for round_ in range(args.rounds):
            run = f"{size}-{round_}"
            times["raw"].append(raw_step_ms(project, shape, cpu_clock))
            times["generated"].append(
                generated_step_ms(project, root, run, shape, cpu_clock)
            )
            times["generated, erf"].append(
                generated_step_ms(erf_project, root, f"{run}-erf", shape, cpu_clock)
            )
            times["nanoGPT"].append(nano_ms(shape))
            if with_lightning:
                times["lightning"].append(lightning_step_ms(project, shape, cpu_clock))
            print(
                f"{size:8} {round_:5d} "
                + " ".join(f"{times[name][-1]:17.2f}" for name in columns)
                + f"  {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        print(
            f"{size:8} {'median':>5} "
            + " ".join(f"{median(times[name]):17.2f}" for name in columns)
        )

        def ratio(reference: str, arm: str) -> float:
            """Steps/s of `arm` over `reference`: the median of each round's ratio."""
            pairs = zip(times[reference], times[arm])
            return median([ref / ms for ref, ms in pairs])

        summary.append(
            f"{size}: generated/raw {ratio('raw', 'generated'):.3f}, "
            f"generated/nanoGPT {ratio('nanoGPT', 'generated'):.3f}, "
            f"generated with nanoGPT's GELU/nanoGPT {ratio('nanoGPT', 'generated, erf'):.3f}"
            + (
                f", lightning/raw {ratio('raw', 'lightning'):.3f}"
                if with_lightning
                else ""
            )
        )
    print(f"steps/s ratios (median of the rounds'); load average {os.getloadavg()}")
    for line in summary:
        print(f"overhead: {line}")


if __name__ == "__main__":
    main()
