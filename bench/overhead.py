"""Loop overhead: the generated gpt2-baseline loop against a minimal hand-written PyTorch loop.

Both do the same work: the same model, data, seed, AdamW, gradient accumulation over the same
microbatches, gradient clipping and LR schedule. The generated loop runs as shipped (progress,
metrics.jsonl and log every step), with evaluation and checkpoints out of the timed steps.
Where Lightning is installed (optional), its Trainer runs the same work as a third column.
Runs alternate A B A B ... in one invocation; each reports its median step time after warmup.

    python bench/overhead.py [--rounds 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from _common import ALLOCATOR, bench_env, generate, median, scratch, train

WARMUP_STEPS = 5

# The hand-written reference: nanoGPT-style, nothing but the work.
RAW_LOOP = r'''
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
    lr=lr_peak, betas=(0.9, 0.95))
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
'''


# The same work under Lightning's Trainer (when installed): a dataloader of microbatches,
# accumulate_grad_batches for accumulation, gradient_clip_val for clipping, the same schedule.
LIGHTNING_LOOP = r'''
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
'''


def lightning_step_ms(project: Path, preset: str, seq_len: int, batch: int, micro: int, steps: int) -> float:
    result = subprocess.run(
        [sys.executable, "-c", LIGHTNING_LOOP, str(project), preset, str(seq_len), str(batch), str(micro), str(steps)],
        env=bench_env(), capture_output=True, text=True, check=True,
    )
    return 1000 * median(json.loads(result.stdout.strip().splitlines()[-1])[WARMUP_STEPS:])


def raw_step_ms(project: Path, preset: str, seq_len: int, batch: int, micro: int, steps: int) -> float:
    result = subprocess.run(
        [sys.executable, "-c", RAW_LOOP, str(project), preset, str(seq_len), str(batch), str(micro), str(steps)],
        env=bench_env(), capture_output=True, text=True, check=True,
    )
    return 1000 * median(json.loads(result.stdout)[WARMUP_STEPS:])


def generated_step_ms(project: Path, workdir: Path, run: str, preset: str, seq_len: int, batch: int,
                      micro: int, steps: int) -> float:
    records = train(project, workdir, run, f"--model={preset}", f"--seq_len={seq_len}",
                    f"--global_batch_size={batch}", f"--device_microbatch_size={micro}",
                    f"--max_duration={steps}ba", f"--eval_interval={steps}ba", f"--save_interval={steps}ba",
                    "--eval_batches=1", "--autoresume=false")
    return median([r["step_ms"] for r in records][WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs per size")
    parser.add_argument("--steps", type=int, default=60, help="steps per run (tiny); the larger size runs a third")
    args = parser.parse_args()
    root = scratch()
    project = generate("gpt2-baseline", root)
    sizes = {
        # (preset, seq_len, global batch, microbatch, steps): per-step overhead dominates ...
        "tiny": ("tiny", 128, 16, 8, args.steps),
        # ... and compute dominates.
        "larger": ("small", 256, 8, 4, max(WARMUP_STEPS + 5, args.steps // 3)),
    }
    print(f"allocator: {' '.join(f'{k}={v}' for k, v in ALLOCATOR.items())}; torch threads: default")
    with_lightning = importlib.util.find_spec("lightning") is not None  # optional, never required
    print(f"{'size':8} {'round':>5} {'raw ms/step':>12} {'generated ms/step':>18}"
          + (f" {'lightning ms/step':>18}" if with_lightning else ""))
    ratios = {}
    for size, (preset, seq_len, batch, micro, steps) in sizes.items():
        raw, gen, lit = [], [], []
        for round_ in range(args.rounds):
            raw.append(raw_step_ms(project, preset, seq_len, batch, micro, steps))
            gen.append(generated_step_ms(project, root, f"{size}-{round_}", preset, seq_len, batch, micro, steps))
            if with_lightning:
                lit.append(lightning_step_ms(project, preset, seq_len, batch, micro, steps))
            print(f"{size:8} {round_:5d} {raw[-1]:12.2f} {gen[-1]:18.2f}"
                  + (f" {lit[-1]:18.2f}" if lit else ""), flush=True)
        # steps/s ratio = raw time / generated time
        ratios[size] = median(raw) / median(gen)
        print(f"{size:8} {'median':>5} {median(raw):12.2f} {median(gen):18.2f}"
              + (f" {median(lit):18.2f}" if lit else "")
              + f"   generated/raw steps_per_s = {ratios[size]:.3f}"
              + (f", lightning/raw = {median(raw) / median(lit):.3f}" if lit else ""))
    print(f"overhead: generated/raw steps_per_s = {ratios['tiny']:.2f} (tiny), {ratios['larger']:.2f} (larger)")


if __name__ == "__main__":
    main()
