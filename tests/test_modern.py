"""The speedrun-era GPT algorithms (rotary, QK-norm, ReLU², GLU, zero-init, logit soft-capping,
value embeddings, Muon): each one's effect, checked in the code the generator writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from projects import project_modules
from scaffold.answers import resolve
from scaffold.paths import template_dir
from scaffold.recipes import RecipeError, load_recipe
from scaffold.render import new_project

TEMPLATE = template_dir()


def make_project(root: Path, algorithms: str) -> Path:
    """A project with the baseline answers and these `[algorithms.x]` tables."""
    root.mkdir(parents=True, exist_ok=True)
    recipe = root / "recipe.toml"
    recipe.write_text(algorithms)
    project = root / "p"
    new_project(str(recipe), project, [], "p")
    return project


@pytest.fixture(scope="module")
def modern(generated: dict[str, Path]):
    with project_modules(generated["gpt2-modern"]) as modules:
        yield modules


@pytest.fixture(scope="module")
def glu(tmp_path_factory: pytest.TempPathFactory):
    project = make_project(
        tmp_path_factory.mktemp("glu"), "[algorithms.gated_linear_units]\n"
    )
    with project_modules(project) as modules:
        yield modules


def tiny(model, **overrides):
    sizes = {**model.PRESETS["tiny"], **overrides}
    return model.GPTConfig(vocab_size=64, max_seq_len=32, **sizes)


# ---------------------------------------------------------------- rotary


def test_rotary_scores_depend_only_on_the_offset(modern) -> None:
    rotary = modern["model"].rotary
    torch.manual_seed(0)
    a, b = torch.randn(2, 16)

    def score(i: int, j: int) -> float:
        """q = a at position i, k = b at position j, both rotated in a length-20 sequence."""
        q, k = torch.zeros(1, 1, 20, 16), torch.zeros(1, 1, 20, 16)
        q[0, 0, i], k[0, 0, j] = a, b
        q, k = rotary(q, base=10000.0, fraction=1.0), rotary(
            k, base=10000.0, fraction=1.0
        )
        return (q[0, 0, i] @ k[0, 0, j]).item()

    for i, j in [(5, 2), (9, 9), (3, 0)]:
        for shift in (1, 7, 10):
            assert score(i + shift, j + shift) == pytest.approx(score(i, j), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)  # the offset matters
    assert score(5, 2) != pytest.approx((a @ b).item(), abs=1e-3)


def test_rotary_keeps_position_zero_norms_and_unrotated_dims(modern) -> None:
    rotary = modern["model"].rotary
    x = torch.randn(2, 3, 10, 16)
    half = rotary(x, base=10000.0, fraction=0.5)
    torch.testing.assert_close(
        half[..., 8:], x[..., 8:]
    )  # the other half passes through
    torch.testing.assert_close(half[:, :, 0], x[:, :, 0])  # angle 0 at position 0
    torch.testing.assert_close(half.norm(dim=-1), x.norm(dim=-1))  # a rotation
    assert not torch.allclose(half[:, :, 1:, :8], x[:, :, 1:, :8])


def test_rotary_model_has_no_position_table(modern, generated) -> None:
    names = {
        name
        for name, _ in modern["model"].GPT(tiny(modern["model"])).named_parameters()
    }
    assert not any(name.startswith("wpe") for name in names)
    with project_modules(generated["gpt2-baseline"]) as baseline:
        model = baseline["model"]
        assert "wpe.weight" in {
            name for name, _ in model.GPT(tiny(model)).named_parameters()
        }


def test_rotary_conflicts_with_alibi(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text("[algorithms.rotary]\n[algorithms.alibi]\n")
    with pytest.raises(RecipeError, match="'rotary' and 'alibi' conflict"):
        resolve(load_recipe(str(recipe), TEMPLATE), TEMPLATE, "p")


# ---------------------------------------------------------------- qk_norm


def test_qk_norm_gives_unit_rms_queries_and_keys_per_head(modern) -> None:
    model = modern["model"]
    attention = model.CausalSelfAttention(tiny(model))
    seen = []
    for norm in (attention.q_norm, attention.k_norm):
        norm.register_forward_hook(lambda module, args, out: seen.append(out))
    attention(torch.randn(2, 9, 128) * 5)  # no attn_bias: no algorithm fills it
    assert len(seen) == 2
    for out in seen:
        assert out.shape == (2, 4, 9, 32)  # (batch, head, seq, head_dim)
        rms = out.pow(2).mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.ones_like(rms), rtol=1e-4, atol=1e-4)


def test_qk_norm_attention_equals_a_hand_computation(modern) -> None:
    model = modern["model"]
    attention = model.CausalSelfAttention(tiny(model))
    x = torch.randn(1, 6, 128)
    q, k, v = (
        t.view(1, 6, 4, 32).transpose(1, 2) for t in attention.qkv(x).split(128, dim=2)
    )

    def rms_norm(t):
        return t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(t.dtype).eps).sqrt()

    q, k = (model.rotary(rms_norm(t), base=10000.0, fraction=1.0) for t in (q, k))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(32)).masked_fill(
        torch.ones(6, 6).triu(1).bool(), float("-inf")
    )
    manual = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 128)
    torch.testing.assert_close(
        attention(x), attention.proj(manual), rtol=1e-5, atol=1e-5
    )


# ---------------------------------------------------------------- relu_squared and GLU


def test_relu_squared_mlp_equals_a_hand_computation(modern) -> None:
    model = modern["model"]
    mlp = model.MLP(tiny(model))
    x = torch.randn(3, 5, 128)
    manual = mlp.proj(torch.clamp(mlp.fc(x), min=0) ** 2)
    torch.testing.assert_close(mlp(x), manual)


def test_glu_mlp_equals_a_hand_computation(glu) -> None:
    """At its defaults the gate goes through GPT-2's own activation, the tanh GELU
    (Composer's GatedLinearUnits takes the model's own: GeGLU)."""
    model = glu["model"]
    mlp = model.MLP(tiny(model))
    hidden = model.glu_hidden(128)
    x = torch.randn(3, 5, 128)
    value = x @ mlp.fc.weight[:hidden].T + mlp.fc.bias[:hidden]
    gate = x @ mlp.fc.weight[hidden:].T + mlp.fc.bias[hidden:]
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    manual = mlp.proj(value * 0.5 * gate * (1 + torch.tanh(inner)))
    torch.testing.assert_close(mlp(x), manual, rtol=1e-5, atol=1e-5)
    swish = mlp.proj(value * gate * torch.sigmoid(gate))  # silu(g) = g * sigmoid(g)
    assert not torch.allclose(mlp(x), swish, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("n_embd", [128, 384, 768, 1024, 1280, 1600])
def test_glu_parameter_count_follows_the_rule(glu, n_embd: int) -> None:
    """Hidden = 2/3 of 4 n_embd rounded down to a multiple of 8: the three matrices never hold
    more weights than the GELU MLP's two, and the whole MLP is within 2% of its size."""
    model = glu["model"]
    hidden = model.glu_hidden(n_embd)
    assert hidden % 8 == 0 and hidden <= 8 * n_embd / 3 < hidden + 8
    config = tiny(model, n_embd=n_embd, n_head=n_embd // 64 if n_embd >= 384 else 4)
    glu_params = sum(p.numel() for p in model.MLP(config).parameters())
    gelu_params = (n_embd * 4 * n_embd + 4 * n_embd) + (4 * n_embd * n_embd + n_embd)
    assert glu_params == 3 * n_embd * hidden + 2 * hidden + n_embd
    assert 3 * n_embd * hidden <= 2 * n_embd * 4 * n_embd
    assert abs(glu_params - gelu_params) <= 0.02 * gelu_params


def test_glu_activation_choice_is_checked(tmp_path: Path) -> None:
    project = make_project(
        tmp_path, '[algorithms.gated_linear_units]\nactivation = "silu"\n'
    )
    assert "h = value * F.silu(gate)" in (project / "model.py").read_text()
    recipe = tmp_path / "bad.toml"
    recipe.write_text('[algorithms.gated_linear_units]\nactivation = "relu"\n')
    with pytest.raises(
        RecipeError,
        match="gated_linear_units.activation = 'relu' is not one of 'silu', 'gelu'",
    ):
        resolve(load_recipe(str(recipe), TEMPLATE), TEMPLATE, "p")


def test_relu_squared_conflicts_with_glu(tmp_path: Path) -> None:
    recipe = tmp_path / "r.toml"
    recipe.write_text("[algorithms.relu_squared]\n[algorithms.gated_linear_units]\n")
    with pytest.raises(RecipeError, match="conflict"):
        resolve(load_recipe(str(recipe), TEMPLATE), TEMPLATE, "p")


# ---------------------------------------------------------------- zero_init


def test_zero_init_starts_at_the_uniform_loss_with_an_untied_head(modern) -> None:
    model = modern["model"]
    gpt = model.GPT(tiny(model))
    assert gpt.lm_head.weight.data_ptr() != gpt.wte.weight.data_ptr()
    assert gpt.lm_head.weight.abs().sum() == 0 and gpt.wte.weight.abs().sum() > 0
    for block in gpt.blocks:
        assert (
            block.attn.proj.weight.abs().sum() == 0
            and block.mlp.proj.weight.abs().sum() == 0
        )
    idx = torch.randint(0, 64, (2, 16))
    logits = gpt(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), idx.flatten())
    assert loss.item() == pytest.approx(math.log(64), abs=1e-6)
    # The untied head is a parameter of its own: counted on top of the embedding.
    assert gpt.num_params() == sum(p.numel() for p in gpt.parameters())
    assert {n for n, _ in gpt.named_parameters()} >= {"wte.weight", "lm_head.weight"}


# ---------------------------------------------------------------- logit_softcap


def test_logit_softcap_bounds_logits_and_the_loss_uses_them(modern) -> None:
    model = modern["model"]
    gpt = model.GPT(tiny(model))
    with torch.no_grad():
        gpt.lm_head.weight.normal_(0.0, 1.5)  # raw logits beyond the cap
    raw = []
    gpt.lm_head.register_forward_hook(lambda module, args, out: raw.append(out))
    idx = torch.randint(0, 64, (2, 16))
    logits = gpt(idx)
    assert raw[0].abs().max() > 40
    assert logits.abs().max() < 30.0
    expected = 30.0 * torch.tanh(raw[0] / 30.0)
    torch.testing.assert_close(logits, expected)
    by_hand = -(expected.log_softmax(-1).gather(-1, idx[..., None])).mean()
    torch.testing.assert_close(
        F.cross_entropy(logits.flatten(0, 1), idx.flatten()), by_hand
    )


# ---------------------------------------------------------------- muon


def hand_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Muon's quintic iteration written out plainly: X <- aX + b(XX^T)X + c(XX^T)^2 X."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_newton_schulz_is_the_quintic_iteration_and_torchs(modern) -> None:
    newton_schulz = modern["train"].newton_schulz
    torch.manual_seed(0)
    for shape in [(24, 40), (40, 16)]:
        g = torch.randn(shape)
        ours = newton_schulz(g)
        # fp32 on a CPU (bf16 on a GPU): the hand iteration in float64 to fp32 rounding
        assert ours.dtype == torch.float32 and ours.shape == shape
        torch.testing.assert_close(
            ours, hand_newton_schulz(g.double()).float(), atol=1e-5, rtol=1e-5
        )
        from torch.optim._muon import _zeropower_via_newtonschulz

        # torch's is the same iteration, always in bf16
        theirs = _zeropower_via_newtonschulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
        torch.testing.assert_close(ours, theirs.float(), atol=0.03, rtol=0.03)
        # nearly orthogonal: singular values in about [0.7, 1.2]
        singular = torch.linalg.svdvals(ours.float())
        assert singular.min() > 0.6 and singular.max() < 1.25


def test_one_muon_step_on_a_single_matrix_is_a_hand_newton_schulz_update(
    modern,
) -> None:
    from runtime import muon

    train = modern["train"]
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(24, 16))
    start = weight.detach().clone()
    weight.grad = torch.randn(24, 16)
    lr, momentum, decay = 0.02, 0.9, 0.1
    muon.Muon(
        [weight], train.newton_schulz, lr=lr, weight_decay=decay, momentum=momentum
    ).step()
    buffer = (1 - momentum) * weight.grad  # momentum from zero
    nesterov = weight.grad + momentum * (buffer - weight.grad)
    scale = lr * math.sqrt(24 / 16)  # lr * sqrt(max(1, rows / cols))
    expected = (
        start * (1 - lr * decay) - scale * hand_newton_schulz(nesterov.double()).float()
    )
    torch.testing.assert_close(weight.detach(), expected, atol=1e-5 * scale, rtol=0)
    # and what torch.optim.Muon does, up to its bf16 iterations
    twin = torch.nn.Parameter(start.clone())
    twin.grad = weight.grad.clone()
    torch.optim.Muon([twin], lr=lr, weight_decay=decay, momentum=momentum).step()
    torch.testing.assert_close(
        twin.detach(), weight.detach(), atol=0.03 * scale, rtol=0
    )


@pytest.mark.parametrize("shape", [(24, 16), (16, 40)])
def test_normuon_evens_out_the_neurons_steps_and_keeps_the_update_norm(
    modern, shape: tuple[int, int]
) -> None:
    """NorMuon (Li et al. 2025; modded-nanogpt's variance reduction): two steps on one
    matrix equal a hand computation, a neuron being a row of a tall matrix and a column of
    a wide one; after the first step every neuron's update has the same norm (its second
    moment is its own mean square), and each update keeps the orthogonalised norm."""
    from runtime import muon

    newton_schulz = modern["train"].newton_schulz
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(shape))
    lr, momentum, beta2 = 0.02, 0.9, 0.9
    optimizer = muon.Muon(
        [weight], newton_schulz, lr=lr, weight_decay=0.0, momentum=momentum, beta2=beta2
    )
    scale = lr * math.sqrt(max(1, shape[0] / shape[1]))
    axis = 1 if shape[0] >= shape[1] else 0  # the entries of one neuron
    buffer = torch.zeros(shape, dtype=torch.float64)
    second = torch.zeros(1, dtype=torch.float64)
    for step in range(2):
        weight.grad = torch.randn(shape)
        grad = weight.grad.double()
        before = weight.detach().double().clone()
        optimizer.step()
        buffer = momentum * buffer + (1 - momentum) * grad
        ortho = hand_newton_schulz(grad + momentum * (buffer - grad))
        second = beta2 * second + (1 - beta2) * ortho.square().mean(axis, keepdim=True)
        normalized = ortho / second.sqrt()
        expected = normalized * ortho.norm() / normalized.norm()
        taken = (before - weight.detach().double()) / scale
        torch.testing.assert_close(taken, expected, atol=1e-4, rtol=1e-4)
        assert taken.norm().item() == pytest.approx(ortho.norm().item(), rel=1e-4)
        if step == 0:
            neurons = taken.norm(dim=axis)
            assert neurons.max() / neurons.min() < 1 + 1e-4
            plain = ortho.norm(dim=axis)  # without NorMuon they differ
            assert plain.max() / plain.min() > 1.05


def test_muon_takes_the_blocks_weight_matrices_and_nothing_else(modern) -> None:
    model = modern["model"]
    gpt = model.GPT(tiny(model))
    hidden, rest = modern["train"].muon_split(gpt)
    names = {id(p): name for name, p in gpt.named_parameters()}
    muon_names = {names[id(p)] for p in hidden}
    expected = {
        f"blocks.{i}.{m}.weight"
        for i in range(4)
        for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    }
    assert muon_names == expected
    assert {names[id(p)] for p in rest} == set(names.values()) - expected
    assert {"wte.weight", "lm_head.weight"} <= {names[id(p)] for p in rest}
    assert all(p.dim() == 2 for p in hidden)


def test_muon_momentum_warms_up_from_085(modern) -> None:
    train = modern["train"]
    cfg = train.Config()  # 600ba, warmup 0.1dur: 60 steps
    at = train.muon_momentum_at
    assert at(0.0, cfg, 1) == pytest.approx(0.85)
    assert at(0.05, cfg, 1) == pytest.approx(0.90)
    assert at(0.1, cfg, 1) == at(0.7, cfg, 1) == pytest.approx(0.95)


def test_muon_under_fsdp_on_two_ranks_equals_one_process_with_two_collectives_per_matrix(
    tmp_path: Path,
) -> None:
    """runtime.muon.Muon on FSDP2 (2 gloo ranks, uneven shards, a rank holding no rows of a
    1-row matrix) takes the same steps as one process, with and without NorMuon; one step costs one gather and
    one scatter per matrix, and the Newton–Schulz work is split over the ranks."""
    import json
    import subprocess
    import sys

    from projects import REPO, checkout_env

    out = tmp_path / "muon.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "tests" / "muon_worker.py"),
            str(out),
        ],
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(out.read_text())
    assert found["max_change_from_init"] > 1e-3  # the steps moved the weights
    assert (
        found["max_diff_torch_muon_vs_ours"] == 0.0
    )  # one process: torch.optim.Muon's steps
    assert found["max_diff_fsdp_vs_one_process"] <= 1e-6
    assert found["collectives_ours"] == {
        "gather_": found["matrices"],
        "scatter_": found["matrices"],
    }
    assert found["newton_schulz_per_rank"] == [
        2,
        2,
    ]  # 4 matrices, each orthogonalised once
    assert found["momentum_buffer_shapes"] == [[40, 16], [24, 40], [7, 24], [1, 7]]
    # NorMuon: the same on FSDP2 as on one process, and not Muon's steps; a second moment
    # per row of the tall matrix, per column of the wide ones (sharded rows: 4 + 3 of 7,
    # and none on rank 1 for the 1-row matrix); two all-reduces per step for all matrices.
    assert found["normuon_max_diff_fsdp_vs_one_process"] <= 1e-6
    assert found["normuon_max_diff_from_muon"] > 1e-3
    assert found["normuon_second_moment_shapes"] == [[40, 1], [1, 40], [1, 24], [1, 7]]
    assert found["normuon_collectives"] == {
        "gather_": found["matrices"],
        "scatter_": found["matrices"],
        "allreduce_": 2,
    }


@pytest.mark.parametrize(
    "recipe",
    [
        "gpt2-modern",
        pytest.param("gpt2-speedrun", marks=pytest.mark.slow),
        pytest.param("gpt2-modern+unet_skips", marks=pytest.mark.slow),
    ],
)
def test_modern_recipe_on_two_fsdp_ranks_equals_one_process_and_resumes_on_one(
    recipe: str, generated: dict[str, Path], tmp_path: Path
) -> None:
    """The generated gpt2-modern loop (Muon + AdamW in one Chain) on 2 FSDP2 ranks matches one
    process; its step-2 checkpoint (Muon's momentum sharded over 2 ranks) resumes on 1 process
    and continues as the 1-process run does (step 4's loss depends on the restored momentum).
    gpt2-speedrun (--slow): the same with Polar Express, cautious weight decay on sharded
    rows and the bigram table in FSDP2's root unit. gpt2-modern+unet_skips (--slow): the
    skip weights in the root unit, the blocks' outputs kept across FSDP2's block units.
    """
    import subprocess
    import sys

    from projects import checkout_env, read_metrics, run_train

    base, _, added = recipe.partition("+")
    project = generated[base]
    if added:
        modern = (TEMPLATE / "recipes" / f"{base}.toml").read_text()
        project = make_project(tmp_path / "made", f"{modern}\n[algorithms.{added}]\n")
    small = [
        "--seq_len=32",
        "--global_batch_size=12",
        "--device_microbatch_size=2",
        "--max_duration=4ba",
        "--eval_interval=2ba",
        "--save_interval=2ba",
        "--eval_batches=1",
        "--dist_timeout=60",
    ]
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(project / "train.py"),
            "--device=cpu",
            "--run_name=two",
            *small,
        ],
        cwd=tmp_path,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_train(project, tmp_path, "--run_name=one", *small)
    assert one.returncode == 0, one.stderr[-3000:]
    resumed = run_train(
        project,
        tmp_path,
        "--run_name=resumed",
        *small,
        f"--load_path={tmp_path / 'runs' / 'two' / 'checkpoints' / 'step-2'}",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def losses(run: str) -> dict[int, float]:
        return {
            row["step"]: row["loss"]
            for row in read_metrics(tmp_path, run)
            if "loss" in row
        }

    assert losses("two") == pytest.approx(losses("one"), rel=1e-5)
    assert sorted(losses("resumed")) == [3, 4]
    assert losses("resumed")[4] == pytest.approx(losses("one")[4], rel=1e-5)
    assert losses("one")[4] < losses("one")[1]


@pytest.mark.parametrize("algorithm", ["muon", "rotary"])
def test_remove_then_add_on_an_edited_modern_project(
    algorithm: str, tmp_path: Path
) -> None:
    """`scaffold remove` brings back the host's default code the algorithm replaced (the AdamW
    construction; learned positions), and `scaffold add` restores the edited project exactly.
    """
    from conftest import scaffold_cli
    from test_upgrade import commit_all, files_of, make_hand_edits

    project = tmp_path / "my-gpt"
    made = scaffold_cli("new", "--recipe", "gpt2-modern", str(project))
    assert made.returncode == 0, made.stderr
    make_hand_edits(project, delete_clipping=False)
    edited = files_of(project)
    removed = scaffold_cli("remove", algorithm, str(project))
    assert removed.returncode == 0, removed.stderr
    train, model = (project / "train.py").read_text(), (
        project / "model.py"
    ).read_text()
    assert f"# algorithm: {algorithm}" not in train + model
    assert "hand edit: inside the loop" in train and "beta2: float = 0.99" in train
    if algorithm == "muon":
        assert "optimizer = torch.optim.AdamW(" in train and "muon" not in train
    else:
        assert "self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)" in model
    commit_all(project, f"no {algorithm}")
    added = scaffold_cli("add", algorithm, str(project))
    assert added.returncode == 0, added.stderr
    assert files_of(project) == edited


# ---------------------------------------------------------------- value_embeddings


@pytest.fixture(scope="module")
def value_embeddings(tmp_path_factory: pytest.TempPathFactory):
    project = make_project(
        tmp_path_factory.mktemp("ve"), "[algorithms.value_embeddings]\n"
    )
    with project_modules(project) as modules:
        yield modules


def test_value_embeddings_change_the_values_by_the_embedding_term(
    value_embeddings,
) -> None:
    model = value_embeddings["model"]
    attention = model.CausalSelfAttention(tiny(model))
    with torch.no_grad():
        attention.value_mix.copy_(torch.tensor([0.7, 0.4]))
    x, embed = torch.randn(2, 6, 128), torch.randn(2, 6, 128)
    q, k, v = (
        t.view(2, 6, 4, 32).transpose(1, 2) for t in attention.qkv(x).split(128, dim=2)
    )

    def attend(values: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(q, k, values, is_causal=True)
        return attention.proj(y.transpose(1, 2).reshape(2, 6, 128))

    with_embed = 0.7 * v + 0.4 * embed.view(2, 6, 4, 32).transpose(1, 2)
    # forward(x, layer_input): no attn_bias, which no algorithm of this project fills
    torch.testing.assert_close(
        attention(x, embed), attend(with_embed), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        attention(x, None), attend(0.7 * v), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("n_layer", "fed"), [(4, [0, 1, 1, 0]), (8, [0, 1, 2, None, None, 2, 1, 0])]
)
def test_value_embedding_tables_feed_the_first_and_last_layers(
    value_embeddings, n_layer: int, fed: list
) -> None:
    model = value_embeddings["model"]
    gpt = model.GPT(tiny(model, n_layer=n_layer))
    assert len(gpt.value_embeds) == max(t for t in fed if t is not None) + 1
    seen = []
    for block in gpt.blocks:
        block.attn.register_forward_pre_hook(
            lambda module, args: seen.append(args[1])
        )  # (x, layer_input)
    idx = torch.randint(0, 64, (2, 8))
    gpt(idx)
    for layer_input, table in zip(seen, fed):
        if table is None:
            assert layer_input is None
        else:
            torch.testing.assert_close(layer_input, gpt.value_embeds[table](idx))
