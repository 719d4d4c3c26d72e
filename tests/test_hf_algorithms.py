"""layer_freezing and low_precision_layernorm on the text_classification task: their effects
(layer freezing by Composer's leaf modules and by FSDP units), and layer freezing's bitwise
resume after the process dies (Composer's cannot resume).
low_precision_layernorm lives in model.py (issue 25): load_model turns transformers' LayerNorm
layers into it, and the GPT (causal_lm) builds its LayerNorms as such."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from conftest import scaffold_cli  # noqa: E402
from projects import checkout_env, project_modules, read_metrics  # noqa: E402
from runtime.checkpoint import export_safetensors  # noqa: E402
from scaffold.render import new_project  # noqa: E402

SMALL = [
    "--device=cpu",
    "--max_seq_len=16",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_batches=1",
    "--eval_interval=2ba",
    "--lr=1e-3",
]
# train.py, dying like a killed job (no cleanup, no atexit) right after the step-2 checkpoint.
CRASH_AFTER_STEP_2 = """
import os, runpy, sys
import runtime.checkpoint as checkpoint
save = checkpoint.Checkpointer.save
def save_then_die(self, *args, **kwargs):
    path = save(self, *args, **kwargs)
    if path.name == "step-2":
        os._exit(17)
    return path
checkpoint.Checkpointer.save = save_then_die
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))  # the project's data.py and model.py
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def text_project(root: Path, algorithms: str) -> Path:
    """A tiny text_classification project with these `[algorithms.*]` tables."""
    recipe = root / "recipe.toml"
    recipe.write_text(
        '[answers]\ntask = "text_classification"\nmodel_family = "hf"\nmodel = "tiny"\n'
        + algorithms
    )
    result = scaffold_cli("new", "--recipe", str(recipe), str(root / "p"))
    assert result.returncode == 0, result.stderr
    return root / "p"


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> Path:
    return text_project(
        tmp_path_factory.mktemp("hf-algorithms"),
        "[algorithms.layer_freezing]\nstart = 0.0\nlevel = 1.0\n"
        "[algorithms.low_precision_layernorm]\n",
    )


def train(
    project: Path, workdir: Path, *args: str, crash: bool = False
) -> subprocess.CompletedProcess[str]:
    prefix = [sys.executable, "-c", CRASH_AFTER_STEP_2] if crash else [sys.executable]
    return subprocess.run(
        [*prefix, str(project / "train.py"), *SMALL, *args],
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


def composer_layers(module: torch.nn.Module, prefix: str = "") -> list[str]:
    """Composer's LayerFreezing `_get_layers`, with names: a depth-first search for the
    modules that hold parameters and have no children."""
    children = list(module.named_children())
    if not children:
        return [prefix] if any(True for _ in module.parameters()) else []
    return [
        found
        for name, child in children
        for found in composer_layers(child, f"{prefix}{name}.")
    ]


def test_layer_freezing_freezes_composers_leaf_modules_at_its_defaults(
    project: Path, tmp_path: Path
) -> None:
    """units=leaves (the default): the earliest of all but the last of Composer's
    layers (embedding tables, each Linear and LayerNorm, the pooler) stop changing,
    int(count * level * ramp) of them at each step; the later ones and the head train.
    """
    args = ["--max_duration=4ba", "--save_interval=1ba", "--run_name=leaves"]
    args.append("--save_num_checkpoints_to_keep=0")  # keep every step's
    result = train(project, tmp_path, *args)
    assert result.returncode == 0, result.stderr
    with project_modules(project) as modules:
        tokenizer = modules["model"].load_tokenizer("tiny", ["a tiny text"])
        model = modules["model"].load_model("tiny", 2, tokenizer, 16)
    layers = composer_layers(model)
    assert (
        layers[-1] == "classifier." and len(layers) == 22
    )  # 4 + 2 x 8 + pooler + head
    freezable = layers[:-1]
    counts = [int(len(freezable) * (step - 1) / 4) for step in (1, 2, 3, 4)]
    assert [r["frozen_layers"] for r in read_metrics(tmp_path, "leaves")] == counts
    weights = {}
    for step in (2, 3, 4):
        out = tmp_path / f"step-{step}.safetensors"
        export_safetensors(
            tmp_path / "runs" / "leaves" / "checkpoints" / f"step-{step}", out
        )
        weights[step] = load_file(out)

    def changed(layer: str, a: int, b: int) -> bool:
        keys = [k for k in weights[a] if k.startswith(layer)]
        assert keys, layer
        return any(not torch.equal(weights[a][k], weights[b][k]) for k in keys)

    for step in (3, 4):  # frozen: unchanged by the step; the next one trains
        frozen = counts[step - 1]
        assert not any(changed(layer, step - 1, step) for layer in freezable[:frozen])
        assert changed(freezable[frozen], step - 1, step)
        assert changed("classifier.", step - 1, step)


def test_layer_freezing_freezes_earliest_layers_and_resumes_bitwise(
    project: Path, tmp_path: Path
) -> None:
    common = [
        "--max_duration=4ba",
        "--save_interval=1ba",
        "--save_num_checkpoints_to_keep=0",
        "--layer_freezing_units=blocks",
    ]
    whole = train(project, tmp_path, "--run_name=whole", *common)
    assert whole.returncode == 0, whole.stderr
    records = read_metrics(tmp_path, "whole")
    # 3 units (embeddings, 2 layers); step k drops the first int(3 * (k - 1) / 4) units' gradients.
    assert [r["frozen_layers"] for r in records] == [0, 0, 1, 2]

    def weights(step: int) -> dict[str, torch.Tensor]:
        out = tmp_path / f"step-{step}.safetensors"
        export_safetensors(
            tmp_path / "runs" / "whole" / "checkpoints" / f"step-{step}", out
        )
        return load_file(out)

    w = {step: weights(step) for step in (1, 2, 3, 4)}

    def changed(prefix: str, a: int, b: int) -> bool:
        keys = [k for k in w[a] if k.startswith(prefix)]
        assert keys, prefix
        return any(not torch.equal(w[a][k], w[b][k]) for k in keys)

    embeddings, layer0, layer1 = (
        "bert.embeddings.",
        "bert.encoder.layer.0.",
        "bert.encoder.layer.1.",
    )
    assert changed(embeddings, 1, 2) and not changed(
        embeddings, 2, 4
    )  # frozen from step 3
    assert changed(layer0, 2, 3) and not changed(layer0, 3, 4)  # frozen at step 4
    assert changed(layer1, 3, 4) and changed("classifier.", 3, 4)  # never frozen

    crashed = train(project, tmp_path, "--run_name=resumed", *common, crash=True)
    assert crashed.returncode == 17, crashed.stderr
    resumed = train(project, tmp_path, "--run_name=resumed", *common)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
    keys = ("step", "loss", "lr", "frozen_layers", "accuracy", "val_loss")
    assert [[r.get(k) for k in keys] for r in read_metrics(tmp_path, "resumed")] == [
        [r.get(k) for k in keys] for r in records
    ]


def test_low_precision_layernorm_normalizes_in_bf16_under_autocast_only(
    project: Path,
) -> None:
    assert (
        "# algorithm: low_precision_layernorm" not in (project / "train.py").read_text()
    )
    with project_modules(project) as modules:
        model_module = modules["model"]
        # load_model hands back the model with every LayerNorm transformers built made
        # low-precision in place (the embeddings' and each layer's two): same keys.
        texts = ["a tiny text", "another one"]
        tokenizer = model_module.load_tokenizer("tiny", texts)
        loaded = model_module.load_model("tiny", 2, tokenizer, 16)
        norms = [m for m in loaded.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert len(norms) == 5 and all(
            type(m) is model_module.LowPrecisionLayerNorm for m in norms
        )

        torch.manual_seed(0)
        # fp32 input, as the residual stream is: autocast leaves LayerNorm in fp32 (on CUDA it
        # even upcasts bf16 input); the low-precision one normalizes in bf16.
        model = torch.nn.Sequential(
            torch.nn.LayerNorm(8), torch.nn.LayerNorm(8, bias=False)
        )
        with torch.no_grad():
            model[0].weight.uniform_(0.5, 1.5)
            model[0].bias.uniform_(-0.5, 0.5)
        plain = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.randn(4, 8) * 3 + 1
        with torch.autocast("cpu", torch.bfloat16):
            before = model(x)
        eager_before = model(x)
        assert model_module.use_low_precision_layernorm(model) == 2
        assert model.state_dict().keys() == plain.keys()  # checkpoints unchanged
        with torch.autocast("cpu", torch.bfloat16):
            after = model(x)
        assert before.dtype == torch.float32 and after.dtype == torch.bfloat16
        expected = torch.nn.functional.layer_norm(
            torch.nn.functional.layer_norm(
                x.bfloat16(), (8,), model[0].weight.bfloat16(), model[0].bias.bfloat16()
            ),
            (8,),
            model[1].weight.bfloat16(),
        )
        assert torch.equal(after, expected)
        assert torch.allclose(after.float(), before, atol=5e-2) and not torch.equal(
            after.float(), before
        )
        assert torch.equal(
            model(x), eager_before
        )  # without autocast: the plain LayerNorm


def test_low_precision_layernorm_is_how_the_gpt_builds_its_layernorms(
    tmp_path: Path, isolated_home: Path
) -> None:
    """causal_lm: model.py's layer_norm builds every LayerNorm of the GPT as the low-precision
    kind; keys and the GPT-2 layout (HF export) are unchanged, and train.py holds none of it.
    """
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[answers]\ntask = "causal_lm"\n[algorithms.low_precision_layernorm]\n'
    )
    new_project(str(recipe), tmp_path / "gpt", [], "gpt")
    assert (
        "# algorithm: low_precision_layernorm"
        not in (tmp_path / "gpt" / "train.py").read_text()
    )
    with project_modules(tmp_path / "gpt") as modules:
        model_module = modules["model"]
        config = model_module.GPTConfig(
            vocab_size=64, max_seq_len=16, n_layer=2, n_head=2, n_embd=32
        )
        gpt = model_module.GPT(config)
        norms = [m for m in gpt.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert len(norms) == 5 and all(
            type(m) is model_module.LowPrecisionLayerNorm for m in norms
        )
        assert hasattr(model_module, "to_hf_gpt2")  # GPT-2's layout still holds it
        names = set(model_module.hf_gpt2_names(config.n_layer)) | {"lm_head.weight"}
        assert set(gpt.state_dict()) == names
        idx = torch.randint(0, 64, (2, 16))
        with torch.autocast("cpu", torch.bfloat16):
            low = gpt(idx)
        for norm in norms:
            norm.__class__ = torch.nn.LayerNorm
        with torch.autocast("cpu", torch.bfloat16):
            plain = gpt(idx)
        assert torch.allclose(low.float(), plain.float(), atol=0.1) and not torch.equal(
            low, plain
        )


# ---------------------------------------------------------------- gyro_dropout


@pytest.fixture(scope="module")
def gyro_project(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> Path:
    return text_project(
        tmp_path_factory.mktemp("gyro"),
        "[algorithms.gyro_dropout]\nsigma = 8\ntau = 2\n",
    )


def test_gyro_dropout_uses_fixed_masks_per_group_and_stretch(
    gyro_project: Path,
) -> None:
    import transformers

    with project_modules(gyro_project) as loaded:
        model = loaded["model"]
        config = transformers.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, num_labels=3,
        )  # fmt: skip
        torch.manual_seed(0)
        bert = transformers.AutoModelForSequenceClassification.from_config(config)
        # only the head's Dropout (before the classifier) changes; the encoder's stay
        assert model.use_gyro_dropout(bert) == 1
        gyro = bert.dropout
        assert isinstance(gyro, model.GyroDropout)
        kinds = {type(m).__name__ for m in bert.base_model.modules()}
        assert "Dropout" in kinds and "GyroDropout" not in kinds
        # sigma = 8 masks over 16 features, each feature kept with probability 1 - p
        assert gyro.masks.shape == (8, 16) and 0.3 < gyro.masks.mean() < 0.7
        assert "dropout.masks" in bert.state_dict()

        # 32 steps, sigma 8, tau 2: masks change every 32 // 8 * 2 = 8 steps; the global
        # batch of 4 is 2 groups of 2 samples, one mask each
        schedule = bert.gyro_dropout
        stretches = []
        for step in range(32):
            schedule.start_step(7, step, 32, 4, 0, 4)
            rows = schedule.rows.clone()
            assert rows[0] == rows[1] and rows[2] == rows[3]
            if step % 8:
                assert torch.equal(rows, stretches[-1])
            else:
                stretches.append(rows)
        assert len({tuple(r.tolist()) for r in stretches}) > 1  # new masks per stretch
        # a rank's share and a microbatch see the global batch's rows
        schedule.start_step(7, 9, 32, 4, 2, 2)
        assert torch.equal(schedule.rows, stretches[1][2:])
        schedule.start_step(7, 9, 32, 4, 0, 4)
        schedule.start_microbatch(1, 3)
        x = torch.randn(3, 5, 16)  # (batch, positions, features): one mask per sample
        gyro.train()
        expected = (
            x * gyro.masks[stretches[1][1:]][:, None, :] / (1 - model.GYRO_DROPOUT_P)
        )
        torch.testing.assert_close(gyro(x), expected)
        gyro.eval()
        assert torch.equal(gyro(x), x)
