"""Fine-tuning a causal LM (task llm_finetune): packed vs padded rows, LoRA vs full.

    python bench/llm_finetune.py                  # CPU, small scale
    python bench/llm_finetune.py --device=cuda    # a GPU: peak CUDA memory too

Both sides of each ratio run in this invocation, on the same machine, one after the other:
- throughput: `llm-sft` on the offline Q/A data with `--packing=true` and `--packing=false`;
  tokens/s counts tokens that are not padding (the monitor's `tokens_per_s`), the median over
  the steps after the first. Packing fills rows with several conversations, so a step carries
  more real tokens for the same compute.
- memory: `llm-sft` (every weight trained: gradients and AdamW state for all) against
  `llm-lora` (rank 8 on every linear layer), on a larger Llama saved with save_pretrained
  (`--hidden`, `--layers`), the peak of the logged memory: `cuda_max_allocated_gb` on a GPU,
  else the largest `rss_gb` (resident memory after a step: the process, libraries included),
  and the size of the last checkpoint (weights and AdamW state of what is trained: LoRA's
  holds the adapters only).
The load average is printed: on a shared machine the throughput ratio is what to read.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, generate, median, scratch, train  # noqa: E402


def save_llama(folder: Path, hidden: int, layers: int) -> None:
    """A random Llama of the given size with the tiny tokenizer, as a pretrained folder."""
    sys.path.insert(0, str(REPO))
    import torch
    import transformers

    from pydoc_data import topics

    texts = list(topics.topics.values())
    project = generate("llm-sft", folder.parent / "tokenizer-project")
    sys.path.insert(0, str(project))
    import model as model_py  # the generated project's model.py

    tokenizer = model_py.load_tokenizer("tiny", texts)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    print(f"load average: {os.getloadavg()}, cores: {os.cpu_count()}")
    root = scratch()
    common = [
        f"--device={args.device}",
        f"--max_duration={args.steps}ba",
        "--eval_interval=1000ba",
        "--save_interval=1000ba",
        "--samples=0",
        "--seq_len=256",
        "--global_batch_size=16",
        "--device_microbatch_size=8",
    ]
    sft = generate("llm-sft", root)
    rates = {}
    for packing in ("true", "false"):
        records = train(sft, root, f"pack-{packing}", *common, f"--packing={packing}")
        rates[packing] = median([r["tokens_per_s"] for r in records[1:]])
        print(f"packing={packing}: {rates[packing]:,.0f} real tokens/s")
    print(f"ratio: packed/padded tokens/s = {rates['true'] / rates['false']:.2f}")

    base = root / "llama"
    save_llama(base, args.hidden, args.layers)
    lora = generate("llm-lora", root)
    peaks, sizes = {}, {}
    for name, project in (("full", sft), ("lora", lora)):
        records = train(project, root, f"mem-{name}", *common, f"--model={base}")
        key = (
            "cuda_max_allocated_gb"
            if "cuda_max_allocated_gb" in records[0]
            else "rss_gb"
        )
        peaks[name] = max(r[key] for r in records)
        step = root / "runs" / f"mem-{name}" / "checkpoints" / f"step-{args.steps}"
        sizes[name] = sum(f.stat().st_size for f in step.iterdir()) / 2**20
        print(f"{name}: peak {key} {peaks[name]:.3f}, checkpoint {sizes[name]:.1f} MiB")
    print(f"ratio: LoRA/full peak memory = {peaks['lora'] / peaks['full']:.2f}")
    print(f"ratio: LoRA/full checkpoint size = {sizes['lora'] / sizes['full']:.3f}")


if __name__ == "__main__":
    main()
