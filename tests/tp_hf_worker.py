"""A torchrun worker for tests/test_tensor_parallel_hf.py: a generated llm_finetune
project's `tensor_parallel_plan` applied on a 1-D mesh of every rank, against the same
model on one process: the logits, the loss under loss_parallel, the gradients and the
weights after one AdamW step. For the `tiny` Llama (tied embeddings) of the project's
model.py, tiny Qwen2, Qwen3 and Mistral models built from their config classes, and,
from a LoRA project's model.py, the tiny Llama with adapters on every linear layer.

Usage: torchrun --nproc_per_node=N tests/tp_hf_worker.py SFT_PROJECT LORA_PROJECT OUT.json
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

IGNORE = -100
BATCH, SEQ = 2, 16


class Vocabulary:
    """What load_model and complete read of a tokenizer: its size, special tokens,
    and decode."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self) -> int:
        return 256

    def decode(self, ids: torch.Tensor, skip_special_tokens: bool) -> str:
        return " ".join(map(str, ids.tolist()))


def tiny(config_class: type) -> torch.nn.Module:
    """A small random model of `config_class`'s architecture (seeded by the caller)."""
    config = config_class(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def most_apart(ours: dict, theirs: dict) -> float:
    return max((full(ours[n]) - theirs[n]).abs().max().item() for n in theirs)


def compare(
    model: torch.nn.Module, mesh, project_model, own_mask: bool = False
) -> dict:
    """One forward, backward and AdamW step split over `mesh` and whole; the largest
    differences. `own_mask`: transformers builds the documents' mask from position_ids
    (model.py's packed_mask is not passed)."""
    model = model.double()  # float64: a difference is the plan's, not rounding's
    reference = copy.deepcopy(model)
    found = {}
    problem = project_model.tensor_parallel_problem(model, mesh.size())
    assert problem is None, problem
    plan = project_model.tensor_parallel_plan(model)
    parallelize_module(model, mesh, plan)
    # What the first decoder layer's norm and query projection are given: the
    # sequence split (sequence parallel), then gathered whole.
    seen = {}
    layer = project_model.transformers_model(model).model.layers[0]
    for name, module in (
        ("norm", layer.input_layernorm),
        ("attention", layer.self_attn),
    ):
        module.register_forward_pre_hook(
            lambda _, args, kwargs, name=name: seen.update(
                {name: str((args or [kwargs.get("hidden_states")])[0].placements)}
            ),
            with_kwargs=True,
        )
    # Text from the model, greedy and drawn (the same seed on every rank and whole).
    vocabulary = Vocabulary()
    for net in (model, reference):
        written = []
        for temperature, top_k in ((0.0, 0), (0.8, 20)):
            torch.manual_seed(2)
            prompt = [5, 6, 7, 8, 9]  # 5 tokens: 3 and 2 on the ranks, then 1 and 0
            written.append(
                project_model.complete(net, vocabulary, prompt, 6, temperature, top_k)
            )
        found[f"{'tp' if net is model else 'one'}_written"] = written
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 256, (BATCH, SEQ), generator=generator)
    # Two documents in the first row (positions restart), as packing writes them.
    position_ids = torch.arange(SEQ).repeat(BATCH, 1)
    position_ids[0, 10:] -= 10
    targets = torch.randint(3, 256, (BATCH, SEQ), generator=generator)
    targets[:, :4] = IGNORE  # a question's tokens
    steps = []
    for name, net in (("tp", model), ("one", reference)):
        mask = None if own_mask else project_model.packed_mask(net, position_ids)
        logits = net(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=False,
        ).logits
        with loss_parallel():
            loss = F.cross_entropy(
                logits.flatten(0, 1),
                targets.flatten(),
                ignore_index=IGNORE,
                reduction="sum",
            )
            loss.backward()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        grads = {n: p.grad for n, p in net.named_parameters() if p.requires_grad}
        optimizer.step()
        steps.append((full(logits), full(loss), grads, dict(net.named_parameters())))
        found[f"{name}_logits"] = str(getattr(logits, "placements", "whole"))
    (logits, loss, grads, weights), (logits1, loss1, grads1, weights1) = steps
    found |= {f"{name}_input": placements for name, placements in seen.items()}
    found |= {
        "logits": (logits - logits1).abs().max().item(),
        "loss": abs(loss.item() - loss1.item()),
        "loss_value": loss1.item(),
        "grads": most_apart(grads, grads1),
        "weights": most_apart(weights, weights1),
        "names_equal": sorted(grads) == sorted(grads1),  # the same trained
        "split_weights": sorted(
            n for n, p in model.named_parameters() if p.to_local().shape != p.shape
        ),
    }
    return found


def load_project_model(project: Path, name: str) -> ModuleType:
    """`project`'s model.py, imported as `name`."""
    spec = importlib.util.spec_from_file_location(name, project / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def with_lora(lora_model: ModuleType) -> torch.nn.Module:
    """The tiny Llama with LoRA adapters on every linear layer (all-linear), B drawn
    at random (peft starts it at zero: A's gradient would be zero)."""
    torch.manual_seed(0)
    tiny = lora_model.load_model("tiny", Vocabulary(), SEQ, "auto")
    model = lora_model.add_lora(tiny, 4, 8.0, 0.0, "all-linear")
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return model


def main() -> None:
    sft, lora, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    project_model = load_project_model(sft, "sft_model")
    lora_model = load_project_model(lora, "lora_model")

    results = {}
    torch.manual_seed(0)
    llama = project_model.load_model("tiny", Vocabulary(), SEQ, "auto")
    results["llama"] = compare(llama, mesh, project_model)
    head, embedding = llama.lm_head.weight, llama.model.embed_tokens.weight
    results["llama"]["tied"] = head is embedding and isinstance(head, DTensor)
    for config_class in (
        transformers.Qwen2Config,  # biases on q, k, v
        transformers.Qwen3Config,  # per-head norms on q, k
        transformers.MistralConfig,  # transformers' own mask (from position_ids)
    ):
        torch.manual_seed(0)
        name = config_class.model_type
        own_mask = name == "mistral"
        results[name] = compare(tiny(config_class), mesh, project_model, own_mask)
    results["llama_lora"] = compare(with_lora(lora_model), mesh, lora_model)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
