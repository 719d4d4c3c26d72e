"""tensor_parallel=true in the Hugging Face causal-LM pack: model.py's
`tensor_parallel_plan` and `tensor_parallel_problem` (llm-sft and llm-lora generated
with the answer).

One torchrun launch (2 ranks, gloo, CPU; tests/tp_hf_worker.py) applies the plan on a
1-D mesh of both ranks to llm-sft's `tiny` Llama (tied embeddings), to tiny Qwen2
(biases on q, k, v), Qwen3 (per-head norms on q, k) and Mistral models built from their
config classes, and to llm-lora's `tiny` with LoRA adapters on every linear layer (B
drawn at random, so A has a gradient). Each is compared with the same model on one
process: one forward, backward and AdamW step, the weights trained (LoRA: the adapters
only, the norms still frozen), and the text model.py's `complete` writes (greedy and
drawn, with the key/value cache: 1 new token split over 2 ranks).

In float64, so a difference is the plan's, not rounding's: measured at most 9e-16 on
logits, loss and gradients, 6e-13 on the weights after the step (Adam divides by the
root of the squared gradient, so a gradient element near zero carries rounding into its
update at up to lr); the tolerances are 1e-12 and 1e-10. Broken by hand, the plan
misses them by far: without the gather into attention and the MLP (each column-wise
linear given the sequence-split stream) the gradients move by 3e-7 to 1e-6 and the
weights by up to 9e-5; with the head split apart from the tied embedding, the gradients
by 3.4; with torch's SequenceParallel on the norms, LoRA trains them too.

A second launch trains the generated llm-sft project itself (train.py, 2 ranks,
--tensor_parallel=2: the loss under loss_parallel, the data shared by data-parallel rank)
against the same project on one process: the same losses and validation losses within
1e-5 relative (fp32: reduction order).

Refusals run in-process: no launch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from conftest import scaffold_new_many  # noqa: E402
from projects import project_modules, read_metrics, run_train, torchrun  # noqa: E402

WORKER = Path(__file__).resolve().parent / "tp_hf_worker.py"
MODELS = ("llama", "qwen2", "qwen3", "mistral", "llama_lora")
# A few steps of llm-sft's tiny model, a batch of 4 rows for 1 data-parallel rank.
SHORT = [
    "--seq_len=64",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_batches=1",
    "--samples=1",  # an answer written at the evaluation: generate() under the split
    "--sample_tokens=4",
    "--max_duration=3ba",
    "--eval_interval=3ba",
    "--save_interval=3ba",
    "--dist_timeout=60",
]


class Vocabulary:
    """What load_model reads of a tokenizer: its size and special tokens."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, size: int = 256):
        self.size = size

    def __len__(self) -> int:
        return self.size


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llm-sft and llm-lora, generated with tensor_parallel=true."""
    root = tmp_path_factory.mktemp("tensor-parallel")
    projects = {recipe: root / recipe for recipe in ("llm-sft", "llm-lora")}
    scaffold_new_many(
        {
            dest: ["--recipe", recipe, "--set", "tensor_parallel=true"]
            for recipe, dest in projects.items()
        }
    )
    return projects


@pytest.fixture(scope="module")
def model_py(projects: dict[str, Path]):
    with project_modules(projects["llm-sft"]) as modules:
        yield modules["model"]


def test_split_over_two_ranks_matches_one_process(
    projects: dict[str, Path], tmp_path: Path
):
    out = tmp_path / "found.json"
    sft, lora = projects["llm-sft"], projects["llm-lora"]
    result = torchrun(tmp_path, 2, WORKER, sft, lora, out)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert sorted(found) == sorted(MODELS)
    for name, model in found.items():
        # Split: the residual stream by sequence into the norms, gathered whole into
        # attention, the logits by vocabulary (for loss_parallel).
        assert model["norm_input"] == "(Shard(dim=1),)", name
        assert model["attention_input"] == "(Replicate(),)", name
        assert model["tp_logits"] == "(Shard(dim=2),)", name
        splits = {part for n in model["split_weights"] for part in n.split(".")}
        assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= splits, name
        assert {"gate_proj", "up_proj", "down_proj", "embed_tokens"} <= splits, name
        # ... and the same numbers as one process, and the same text written.
        assert model["tp_written"] == model["one_written"], name
        assert len(model["tp_written"][1].split()) == 6, name
        assert model["names_equal"], name  # the same weights trained (LoRA: adapters)
        assert model["loss_value"] > 1.0, name
        assert model["logits"] <= 1e-12, name
        assert model["loss"] <= 1e-12, name
        assert model["grads"] <= 1e-12, name
        assert model["weights"] <= 1e-10, name
    assert found["llama"]["tied"]  # one parameter: lm_head's weight is the embedding's
    assert "lm_head.weight" in found["qwen2"]["split_weights"]
    assert any("q_proj.bias" in n for n in found["qwen2"]["split_weights"])
    # LoRA: the wrapped layer split, and the adapter's matrix on the split side.
    lora = found["llama_lora"]["split_weights"]
    assert any("q_proj.base_layer" in n for n in lora)
    assert any("q_proj.lora_B" in n for n in lora)
    assert any("o_proj.lora_A" in n for n in lora)


def test_refusals_name_the_problem(model_py):
    torch.manual_seed(0)
    tiny = model_py.load_model("tiny", Vocabulary(), 16, "auto")  # 4 heads, 2 kv heads
    problem = model_py.tensor_parallel_problem
    assert problem(tiny, 1) is None
    assert problem(tiny, 2) is None
    assert problem(tiny, 3) == (
        "LlamaForCausalLM's attention heads (4) cannot be split evenly over 3 "
        "tensor-parallel ranks; use a --tensor_parallel that divides 4"
    )
    assert "key/value heads (2)" in problem(tiny, 4)
    odd = model_py.load_model("tiny", Vocabulary(257), 16, "auto")
    assert "vocabulary (257)" in problem(odd, 2)
    # A style model.py does not map, and a weight no entry places (Qwen3's q_norm
    # without the authors' entry for it).
    tiny.config.base_model_tp_plan = {"layers.*.mlp.up_proj": "local_colwise"}
    assert problem(tiny, 2) == (
        "LlamaForCausalLM's tensor-parallel plan splits layers as local_colwise, which "
        "model.py's TP_STYLES does not map to torch; run with --tensor_parallel=1"
    )
    qwen3 = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1
        )
    )
    qwen3.config.base_model_tp_plan = {
        pattern: kind
        for pattern, kind in qwen3.config.base_model_tp_plan.items()
        if not pattern.endswith("q_norm")
    }
    assert problem(qwen3, 2) == (
        "Qwen3ForCausalLM's model.layers.0.self_attn.q_norm.weight is in no module its "
        "tensor-parallel plan splits or replicates; run with --tensor_parallel=1"
    )
    gpt2 = transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    )
    assert problem(gpt2, 2) == (
        "GPT2LMHeadModel's config declares no tensor-parallel plan "
        "(base_model_tp_plan); run with --tensor_parallel=1"
    )


def test_a_wrapped_layer_is_refused(model_py):
    """A project generated without LoRA plans plain layers only: a layer that peft
    wrapped is named, not split wrongly."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    tiny = model_py.load_model("tiny", Vocabulary(), 16, "auto")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    problem = model_py.tensor_parallel_problem(peft.get_peft_model(tiny, config), 2)
    assert problem == (
        "base_model.model.model.layers.0.self_attn.q_proj is a "
        "peft.tuners.lora.layer.Linear, not torch's nn.Linear or nn.Embedding, which "
        "the plan splits; run with --tensor_parallel=1"
    )


def test_the_generated_llm_sft_trains_split_over_two_ranks_as_one_process(
    projects: dict[str, Path], tmp_path: Path
):
    train = projects["llm-sft"] / "train.py"
    split = torchrun(
        tmp_path,
        2,
        train,
        "--device=cpu",
        *SHORT,
        "--tensor_parallel=2",
        "--run_name=tp",
    )
    assert split.returncode == 0, split.stderr[-3000:]
    one = run_train(projects["llm-sft"], tmp_path, *SHORT, "--run_name=one")
    assert one.returncode == 0, one.stderr[-3000:]
    log = (tmp_path / "runs" / "tp" / "log.txt").read_text()
    assert "parallelism: fsdp, tensor_parallel=2, 2 process(es)" in log
    runs = {name: read_metrics(tmp_path, name) for name in ("tp", "one")}
    for key in ("loss", "val_loss"):
        series = {
            name: {row["step"]: row[key] for row in rows if key in row}
            for name, rows in runs.items()
        }
        assert series["tp"].keys() == series["one"].keys() != set(), key
        assert list(series["tp"].values()) == pytest.approx(
            list(series["one"].values()), rel=1e-5
        ), key
