"""The speedrun entries (modded-nanogpt records 11, 38, 43, 62): Polar Express and cautious
weight decay as Muon options, the bigram hash embedding, U-net skip connections; each one's
effect, checked in the code the generator writes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from projects import project_modules
from test_modern import make_project

SPEEDRUN_ENTRIES = """
[algorithms.bigram_hash_embedding]
[algorithms.unet_skips]
[algorithms.muon]
orthogonalizer = "polar_express"
cautious_weight_decay = true
weight_decay = 0.1
"""


@pytest.fixture(scope="module")
def entries(tmp_path_factory: pytest.TempPathFactory):
    project = make_project(tmp_path_factory.mktemp("speedrun"), SPEEDRUN_ENTRIES)
    with project_modules(project) as modules:
        yield modules


def small(model, **overrides):
    sizes = {**model.PRESETS["tiny"], **overrides}
    return model.GPTConfig(vocab_size=64, max_seq_len=32, **sizes)


# ---------------------------------------------------------------- polar express


def hand_polar_express(g: torch.Tensor, coefficients) -> torch.Tensor:
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (x.norm() * 1.02 + 1e-6)
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def test_polar_express_is_the_records_iteration_and_closer_to_orthogonal(
    entries, generated: dict[str, Path]
) -> None:
    train = entries["train"]
    torch.manual_seed(0)
    for shape in [(24, 40), (40, 16)]:
        g = torch.randn(shape)
        ours = train.polar_express(g)
        expected = hand_polar_express(g.double(), train.POLAR_EXPRESS).float()
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
        singular = torch.linalg.svdvals(ours)
        # Newton-Schulz leaves singular values in about [0.7, 1.2]; Polar Express's
        # schedule brings the worst one much closer to 1.
        assert singular.min() > 0.85 and singular.max() < 1.15, singular
    with project_modules(generated["gpt2-modern"]) as modern:
        g = torch.randn(40, 24)
        spread_ns = torch.linalg.svdvals(modern["train"].newton_schulz(g))
        spread_pe = torch.linalg.svdvals(train.polar_express(g))
        assert (spread_pe - 1).abs().max() < (spread_ns - 1).abs().max()


# ---------------------------------------------------------------- cautious weight decay


def test_cautious_weight_decay_decays_only_where_the_update_agrees_in_sign(
    entries,
) -> None:
    from runtime import muon

    train = entries["train"]
    torch.manual_seed(0)
    start = torch.randn(24, 16)
    grad = torch.randn(24, 16)
    lr, decay = 0.02, 0.5
    results = {}
    for cautious in (False, True):
        weight = torch.nn.Parameter(start.clone())
        weight.grad = grad.clone()
        optimizer = muon.Muon(
            [weight],
            train.polar_express,
            lr=lr,
            weight_decay=decay,
            momentum=0.0,
            cautious=cautious,
        )
        optimizer.step()
        results[cautious] = weight.detach()
    update = train.polar_express(grad)  # momentum 0: the update is the gradient's
    scale = lr * math.sqrt(24 / 16)
    agree = update * start > 0
    expected = start - scale * update - lr * decay * start * agree
    torch.testing.assert_close(results[True], expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(
        results[False], start * (1 - lr * decay) - scale * update, atol=1e-6, rtol=0
    )
    # Both kinds of entry occur, and only the agreeing ones differ from no decay.
    assert 0 < agree.sum() < agree.numel()
    undecayed = start - scale * update
    torch.testing.assert_close(
        results[True][~agree], undecayed[~agree], atol=1e-7, rtol=0
    )
    assert not torch.isclose(results[True][agree], undecayed[agree]).any()


def test_recipe_options_reach_the_optimizer(entries) -> None:
    train = entries["train"]
    cfg = train.Config()
    assert cfg.muon_cautious_weight_decay is True
    assert cfg.muon_orthogonalizer == "polar_express"
    update = torch.randn(16, 24)
    torch.testing.assert_close(
        train.muon_orthogonalize(update, cfg), train.polar_express(update)
    )
    cfg.muon_orthogonalizer = "newton_schulz"
    torch.testing.assert_close(
        train.muon_orthogonalize(update, cfg),
        train.newton_schulz(update, cfg.muon_ns_steps),
    )


# ---------------------------------------------------------------- bigram hash embedding


def test_bigram_hash_is_the_records_formula(entries) -> None:
    bigram_hash = entries["model"].bigram_hash
    idx = torch.tensor([[3, 7, 7, 1], [0, 0, 5, 3]])
    rows = 5 * 64
    out = bigram_hash(idx, rows)
    mod = rows - 1
    for row in range(2):
        assert out[row, 0] == mod  # no previous token: the reserved row
        for t in range(1, 4):
            cur, prev = int(idx[row, t]), int(idx[row, t - 1])
            assert out[row, t] == ((36313 * cur) ^ (27191 * prev)) % mod


def test_bigram_table_starts_at_zero_and_adds_its_row_to_the_embedding(
    entries,
) -> None:
    model_module = entries["model"]
    torch.manual_seed(0)
    gpt = model_module.GPT(small(model_module))
    assert gpt.bigram_embed.num_embeddings == 5 * 64
    assert gpt.bigram_embed.weight.abs().sum() == 0
    idx = torch.randint(0, 64, (2, 16))
    before = gpt(idx)
    # With a zero table the model is the plain one; a row added to the table changes the
    # logits exactly at the positions whose bigram hashes to it.
    rows = model_module.bigram_hash(idx, gpt.bigram_embed.num_embeddings)
    target = int(rows[0, 5])
    with torch.no_grad():
        gpt.bigram_embed.weight[target] = 1.0
    after = gpt(idx)
    hit = rows == target
    first_hit = hit.float().argmax(dim=1)
    for b in range(2):
        if hit[b].any():  # causal: positions before the first hit are unchanged
            k = int(first_hit[b])
            torch.testing.assert_close(after[b, :k], before[b, :k])
            assert not torch.allclose(after[b, k], before[b, k])
        else:
            torch.testing.assert_close(after[b], before[b])
    # The gain and the table both learn.
    after.sum().backward()
    assert gpt.bigram_lambda.grad.abs().sum() > 0
    assert gpt.bigram_embed.weight.grad[target].abs().sum() > 0


# ---------------------------------------------------------------- U-net skips


@pytest.mark.parametrize("layers", [4, 5])
def test_unet_skips_feed_each_late_block_its_mirrors_output(entries, layers) -> None:
    model_module = entries["model"]
    torch.manual_seed(0)
    gpt = model_module.GPT(small(model_module, n_layer=layers))
    skips = layers // 2
    assert gpt.skip_weights.tolist() == [1.0] * skips
    with torch.no_grad():  # distinct weights: each skip must use its own
        gpt.skip_weights.copy_(torch.tensor([0.5, 2.0][:skips]))
    inputs, outputs = [], []
    for block in gpt.blocks:
        block.register_forward_pre_hook(lambda _, args: inputs.append(args[0]))
        block.register_forward_hook(lambda _, __, out: outputs.append(out))
    logits = gpt(torch.randint(0, 64, (2, 16)))
    for i in range(1, layers):
        mirror = layers - 1 - i
        expected = outputs[i - 1]
        if mirror < skips:  # the last `skips` blocks; an odd model's middle block: none
            expected = expected + gpt.skip_weights[mirror] * outputs[mirror]
        torch.testing.assert_close(inputs[i], expected, atol=0, rtol=0)
        assert not torch.equal(outputs[mirror], torch.zeros_like(outputs[mirror]))
    logits.float().pow(2).mean().backward()
    assert (gpt.skip_weights.grad.abs() > 0).all()
