"""The masked_lm task with the bert pack: BERT's 80/10/10 masking (rates, special tokens
never picked, the same masks on any world size), the loss normalised by the global batch's
masked tokens whatever the microbatch size, the data sources, the tokenizer trained once
and saved beside the run, and bad input as one line with nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import torch  # noqa: E402

from conftest import scaffold_cli  # noqa: E402
from projects import (
    checkout_env,
    project_modules,
    read_metrics,
    run_train,
)  # noqa: E402


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("mlm") / "bert"
    result = scaffold_cli("new", "--recipe", "mosaicbert", str(dest))
    assert result.returncode == 0, result.stderr
    return dest


@pytest.fixture(scope="module")
def modules(project: Path, tmp_path_factory: pytest.TempPathFactory):
    """The project's modules, with a WordPiece tokenizer trained on the default data
    (in a scratch working directory: its cache is runs/.scaffold-cache)."""
    workdir = tmp_path_factory.mktemp("work")
    before = Path.cwd()
    os.chdir(workdir)
    try:
        with project_modules(project) as found:
            corpus = found["data"].load_corpus("")
            found["data"].train_tokenizer(corpus, 512)
            tokenizer = found["data"].load_tokenizer("", corpus, 512)
            yield found, corpus, tokenizer
    finally:
        os.chdir(before)


def test_masking_is_berts_80_10_10_on_real_tokens_only(modules) -> None:
    found, corpus, tokenizer = modules
    data = found["data"]
    masking = data.Masking.of(tokenizer, 0.3)
    train, _ = data.sequences(corpus, tokenizer, 64, seed=0)
    ids = train.rows(np.arange(len(train)), 64, tokenizer.pad_token_id)
    inputs, targets = masking.apply(ids, np.random.default_rng(0))
    picked = targets != data.IGNORE
    special = np.isin(ids, masking.special_ids)  # [CLS], [SEP], padding
    assert special.any() and not (picked & special).any()
    assert (inputs[~picked] == ids[~picked]).all()  # only picked tokens change
    assert (targets[picked] == ids[picked]).all()
    assert abs(picked.sum() / (~special).sum() - 0.3) < 0.01
    masked = (inputs == tokenizer.mask_token_id)[picked].mean()
    kept = (inputs == ids)[picked].mean()  # 10% stay, plus random draws of itself
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01
    replaced = inputs[picked & (inputs != ids) & (inputs != tokenizer.mask_token_id)]
    assert not np.isin(replaced, masking.special_ids).any()


def test_batches_do_not_depend_on_the_world_size(modules) -> None:
    found, corpus, tokenizer = modules
    data = found["data"]
    train, _ = data.sequences(corpus, tokenizer, 64, seed=0)
    batches = data.Batches(train, 64, 12, data.Masking.of(tokenizer, 0.15), seed=3)
    whole = batches.get(epoch=1, index=5)
    for world in (2, 3):
        shares = [batches.get(1, 5, rank, world) for rank in range(world)]
        assert torch.equal(torch.cat([s.inputs for s in shares]), whole.inputs)
        assert torch.equal(torch.cat([s.targets for s in shares]), whole.targets)
        assert {s.num_masked for s in shares} == {whole.num_masked}
    assert whole.num_masked == int((whole.targets != data.IGNORE).sum())
    other = batches.get(epoch=1, index=6)
    assert not torch.equal(other.targets, whole.targets)


def model_inputs(train_py, ids: torch.Tensor, predicted: torch.Tensor, pad: int):
    """The model's keyword inputs as the loop makes them from the host's marks."""
    marks = {"input_ids": ids, "predicted": predicted, "real": ids != pad}
    return train_py.microbatch_inputs(marks, len(ids))[0]


def test_gradient_is_the_global_masked_token_mean_for_any_microbatch(modules) -> None:
    """forward_backward with loss_scale = 1 / masked tokens: the same gradient as the mean
    cross-entropy over the batch's masked tokens, in 1 or 4 microbatches. The head
    computes logits at the masked tokens only (Google's BERT), and their loss is the
    one of the head over every position with the others ignored. The batch marks its
    real and predicted tokens on the host, which is where the loop finds them."""
    found, corpus, tokenizer = modules
    data, model_py, train_py = found["data"], found["model"], found["train"]
    train, _ = data.sequences(corpus, tokenizer, 32, seed=0)
    batch = data.Batches(train, 32, 8, data.Masking.of(tokenizer, 0.3), 0).get(0, 0)
    config = model_py.EncoderConfig(
        len(tokenizer), 32, pad_id=tokenizer.pad_token_id, **model_py.PRESETS["tiny"]
    )
    torch.manual_seed(0)
    model = model_py.Encoder(config)
    cfg = train_py.Config(precision="fp32")
    picked = batch.targets != data.IGNORE
    assert torch.equal(batch.predicted, picked)
    assert torch.equal(batch.real, batch.inputs != tokenizer.pad_token_id)
    pad = tokenizer.pad_token_id
    logits = model(**model_inputs(train_py, batch.inputs, picked, pad))
    assert logits.shape == (batch.num_masked, config.vocab_size)
    reference = torch.nn.functional.cross_entropy(logits, batch.targets[picked])
    # The same loss as the head over every position with the unmasked ones ignored.
    everything = torch.ones_like(picked)
    every = model(**model_inputs(train_py, batch.inputs, everything, pad))
    every = every.view(*picked.shape, -1)
    everywhere = torch.nn.functional.cross_entropy(
        every.flatten(0, 1), batch.targets.flatten(), ignore_index=data.IGNORE
    )
    assert torch.allclose(everywhere, reference, atol=1e-6)
    head = model.head_fc.weight.numel() + model.wte.weight.numel()  # MFU's count too
    assert model.flops_per_token(32, 0.3) == pytest.approx(
        model.flops_per_token(32, 0.0) + 6 * 0.3 * head
    )
    expected = torch.autograd.grad(reference, list(model.parameters()))
    for microbatch in (8, 2):
        model.zero_grad()
        cfg.device_microbatch_size = microbatch  # what forward_backward splits by
        inputs = {"input_ids": batch.inputs, "predicted": picked, "real": batch.real}
        loss_sum = train_py.forward_backward(
            model,
            inputs,
            batch.targets,
            1 / batch.num_masked,
            cfg,
            train_py.masked_token_loss,
        )
        assert torch.allclose(loss_sum / batch.num_masked, reference, atol=1e-5)
        for grad, param in zip(expected, model.parameters()):
            assert torch.allclose(param.grad, grad, atol=1e-6), microbatch


def test_padding_is_never_attended_to(modules) -> None:
    """A sequence's logits are the same alone and padded beside a longer one."""
    found, _, tokenizer = modules
    model_py, train_py = found["model"], found["train"]
    pad = tokenizer.pad_token_id
    config = model_py.EncoderConfig(
        len(tokenizer), 16, pad_id=pad, **model_py.PRESETS["tiny"]
    )
    model = model_py.Encoder(config).eval()
    short = torch.tensor([[2, 40, 41, 42, 3]])
    padded = torch.full((2, 16), pad)
    padded[0, :5], padded[1] = short[0], torch.arange(30, 46)
    with torch.no_grad():
        alone = model(**model_inputs(train_py, short, short != pad, pad))
        both = model(**model_inputs(train_py, padded, padded != pad, pad))
        assert torch.allclose(alone, both[:5], atol=1e-5)


def test_data_sources(modules, tmp_path: Path) -> None:
    found, _, _ = modules
    data = found["data"]
    text = tmp_path / "a.txt"
    text.write_text("First paragraph here.\n\nSecond one.\n")
    assert data.load_corpus(str(text)).documents == [text.read_text()]
    lines = tmp_path / "b.jsonl"
    lines.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert data.load_corpus(str(lines)).documents == ["one", "two"]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "x.txt").write_text("x words")
    (folder / "y.txt").write_text("y words")
    assert data.load_corpus(str(folder)).documents == ["x words", "y words"]
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["alpha beta", "gamma"]}).save_to_disk(saved)
    assert data.load_corpus(str(saved)).documents == ["alpha beta", "gamma"]
    mds = tmp_path / "mds"
    mds.mkdir()
    (mds / "index.json").write_text(json.dumps({"shards": [], "version": 2}))
    with pytest.raises(ValueError, match="MDS shards are not read"):
        data.load_corpus(str(mds))


def test_the_trained_tokenizer_is_shared_saved_and_its_vocabulary_padded(
    modules, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs of train.main() in this process (a subprocess each cost 20 s here)."""
    small = ["--device=cpu", "--model=tiny", "--seq_len=32", "--global_batch_size=8"]
    small += ["--vocab_size=500", "--max_duration=2ba", "--eval_batches=1"]
    train = modules[0]["train"]
    monkeypatch.chdir(tmp_path)
    for name in ("one", "two"):
        monkeypatch.setattr("sys.argv", ["train.py", f"--run_name={name}", *small])
        try:
            train.main()
        finally:
            train.dist.shutdown()
    cached = list((tmp_path / "runs" / ".scaffold-cache").glob("wordpiece-*.json"))
    assert len(cached) == 1  # trained once, read by the second run
    saved = [
        json.loads((tmp_path / "runs" / n / "tokenizer" / "tokenizer.json").read_text())
        for n in ("one", "two")
    ]
    assert saved[0]["model"]["vocab"] == saved[1]["model"]["vocab"]
    assert len(saved[0]["model"]["vocab"]) == 500
    # mosaicbert's vocab_multiple=64: 500 tokens, 512 embedding rows
    log = (tmp_path / "runs" / "one" / "log.txt").read_text()
    assert "vocabulary 500 (512 embedding rows)" in log
    loaded = transformers.AutoTokenizer.from_pretrained(
        tmp_path / "runs" / "one" / "tokenizer"
    )
    assert loaded.mask_token == "[MASK]"


def test_the_trained_vocabulary_is_the_same_in_every_process(
    project: Path, tmp_path: Path
) -> None:
    """Two processes train the WordPiece tokenizer on the default data, each into its
    own cache: the same vocabulary. tokenizers' trainer alone gives a different one in
    about every process (its continuing pieces numbered in HashMap order)."""
    train = (
        f"import sys; sys.path.insert(0, {str(project)!r}); import data; "
        "data.train_tokenizer(data.load_corpus(''), 4096)"
    )
    workdirs = [tmp_path / name for name in ("one", "two")]
    started = []
    for workdir in workdirs:
        workdir.mkdir()
        started.append(
            subprocess.Popen(
                [sys.executable, "-c", train],
                cwd=workdir,
                env=checkout_env(),
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for process in started:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
    vocabularies = [
        json.loads(next((w / "runs" / ".scaffold-cache").glob("*.json")).read_text())
        for w in workdirs
    ]
    assert vocabularies[0]["model"]["vocab"] == vocabularies[1]["model"]["vocab"]
    assert len(vocabularies[0]["model"]["vocab"]) == 4096
    special = [token["content"] for token in vocabularies[0]["added_tokens"]]
    assert special == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def test_weight_decay_is_on_weight_matrices_only(
    modules, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The saved optimizer's groups: every parameter of two or more dimensions decays
    by weight_decay, every bias, gain and other vector by none (mosaicml/examples' BERT
    decays all; the recipes state it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    small = ["--device=cpu", "--model=tiny", "--seq_len=32", "--global_batch_size=8"]
    small += ["--vocab_size=500", "--max_duration=1ba", "--eval_batches=1"]
    train = modules[0]["train"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["train.py", "--run_name=wd", *small])
    try:
        train.main()
    finally:
        train.dist.shutdown()
    dcp_to_torch_save(tmp_path / "runs/wd/checkpoints/step-1", tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    decay = {
        name: group["weight_decay"]
        for group in state["optimizer"]["param_groups"]
        for name in group["params"]
    }
    assert set(decay) == set(state["model"])  # every parameter, once
    for name, tensor in state["model"].items():
        expected = train.Config().weight_decay if tensor.dim() >= 2 else 0.0
        assert decay[name] == expected, name
    assert 0.0 < train.Config().weight_decay  # the recipe's 0.02: both groups present


def no_mask_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer with padding but no [MASK] (GPT-2 style)."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "the": 2}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]"
    )
    fast.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mask_rate=1.5"], "mask_rate=1.5 is outside its range (0, 1)"),
        (["--mask_rate=0"], "mask_rate=0.0 is outside its range (0, 1)"),
        (["--data=EMPTY"], "holds no text"),
        (["--data=PUNCT"], "holds no tokens"),
        (["--tokenizer=NOMASK"], "has no mask token"),
        (["--seq_len=2"], "seq_len=2"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    modules,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    """train.main() in this process (a subprocess per case cost 6 s of imports each)."""
    (tmp_path / "empty.txt").write_text("  \n\n \t\n")
    (tmp_path / "punct.txt").write_text("\u200b\u200b \u200b\n")
    replace = {
        "EMPTY": str(tmp_path / "empty.txt"),
        "PUNCT": str(tmp_path / "punct.txt"),
        "NOMASK": str(tmp_path / "nomask"),
    }
    if "--tokenizer=NOMASK" in args:
        no_mask_tokenizer(tmp_path / "nomask")
    for key, value in replace.items():
        args = [arg.replace(key, value) for arg in args]
    train = modules[0]["train"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        "sys.argv", ["train.py", "--device=cpu", "--vocab_size=512", *args]
    )
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exited:
            train.main()
    finally:
        train.dist.shutdown()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert message in lines[0], lines[0]
    assert not (tmp_path / "runs").exists() or not [
        p for p in (tmp_path / "runs").iterdir() if p.name != ".scaffold-cache"
    ]


def word_tokenizer(folder: Path, words: int) -> Path:
    """A BERT-style word-level tokenizer of `words` + 5 special tokens."""
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {token: i for i, token in enumerate(special)}
    vocab.update({f"w{i}": len(special) + i for i in range(words)})
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **{
            f"{role}_token": f"[{role.upper()}]"
            for role in ("pad", "unk", "cls", "sep")
        },
        mask_token="[MASK]",
    )
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A masked_lm project on the hf pack, a saved 64-token BertForMaskedLM with its own
    tokenizer, a 205-token tokenizer beside it, and a corpus of its words."""
    root = tmp_path_factory.mktemp("hf-mlm")
    project = root / "project"
    result = scaffold_cli(
        "new",
        "--recipe",
        "bert-pretrain-baseline",
        "--set",
        "model_family=hf",
        "--set",
        "mask_rate=0.3",
        str(project),
    )
    assert result.returncode == 0, result.stderr
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(root / "model")
    word_tokenizer(root / "model", 59)  # 64 tokens: the model's own
    word_tokenizer(root / "big", 200)
    corpus = root / "words.txt"
    rng = np.random.default_rng(0)
    corpus.write_text(
        "\n\n".join(
            " ".join(f"w{i}" for i in rng.integers(59, size=20)) for _ in range(80)
        )
    )
    common = [f"--model={root / 'model'}", f"--data={corpus}", "--seq_len=32"]
    common += ["--global_batch_size=8", "--eval_batches=1", "--max_duration=2ba"]
    return project, common


def test_hf_pack_refuses_a_tokenizer_larger_than_the_model(
    hf_setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project, common = hf_setup
    big = Path(common[0].split("=", 1)[1]).parent / "big"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing downloads
    bad = run_train(project, tmp_path, *common, f"--tokenizer={big}")
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "the tokenizer has 205 tokens" in lines[0], bad.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_hf_pack_trains_a_saved_masked_lm(
    hf_setup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save_pretrained BertForMaskedLM folder and its tokenizer train (test_packs trains
    the pack's tiny random BERT in every run)."""
    project, common = hf_setup
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    good = run_train(project, tmp_path, *common, "--run_name=ok")
    assert good.returncode == 0, good.stderr
    records = [
        json.loads(line)
        for line in (tmp_path / "runs" / "ok" / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    assert [r["step"] for r in records] == [1, 2] and "val_loss" in records[-1]


def test_tensorboard_reads_back_a_masked_lm_runs_metrics(
    modules, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--trackers=tensorboard on a masked_lm run (train.main() in this process):
    TensorBoard's own reader gets the task's loss, val_loss and mlm_accuracy at the
    steps and values metrics.jsonl has."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train = modules[0]["train"]
    workdir = Path.cwd()  # `modules`' scratch folder: its tokenizer is cached there
    args = ["--model=tiny", "--seq_len=32", "--global_batch_size=8", "--vocab_size=512"]
    args += ["--max_duration=2ba", "--eval_interval=1ba", "--eval_batches=1"]
    args += ["--trackers=tensorboard", "--run_name=tb"]
    monkeypatch.setattr("sys.argv", ["train.py", "--device=cpu", *args])
    try:
        train.main()
    finally:
        train.dist.shutdown()
    events = EventAccumulator(str(workdir / "runs" / "tb" / "tensorboard"))
    events.Reload()
    records = read_metrics(workdir, "tb")
    for key in ("loss", "val_loss", "mlm_accuracy"):
        logged = [(r["step"], r[key]) for r in records if key in r]
        read = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in read] == [s for s, _ in logged] == [1, 2], key
        for (_, value), (_, want) in zip(read, logged):
            assert value == pytest.approx(want, rel=1e-6), key


def test_mosaicbert_builds_every_layernorm_in_low_precision(modules) -> None:
    """mosaicbert's low_precision_layernorm: every LayerNorm of the encoder and its head
    is the bf16 kind (BERT's eps kept); under autocast it normalizes in bf16, and its
    logits stay close to the plain LayerNorm's."""
    found, _, tokenizer = modules
    model_py, train_py = found["model"], found["train"]
    config = model_py.EncoderConfig(
        len(tokenizer), 16, pad_id=tokenizer.pad_token_id, **model_py.PRESETS["tiny"]
    )
    torch.manual_seed(0)
    model = model_py.Encoder(config)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * config.n_layer + 2
    assert all(type(m) is model_py.LowPrecisionLayerNorm for m in norms)
    assert {m.eps for m in norms} == {1e-12}
    x = torch.randn(2, 16, config.n_embd)
    with torch.autocast("cpu", torch.bfloat16):
        assert norms[0](x).dtype == torch.bfloat16
        ids = torch.randint(5, len(tokenizer), (2, 16))
        inputs = model_inputs(train_py, ids, ids > 0, tokenizer.pad_token_id)
        low = model(**inputs).float()
        for norm in norms:
            norm.__class__ = torch.nn.LayerNorm
        plain = model(**inputs).float()
    assert norms[0](x).dtype == torch.float32
    assert torch.allclose(low, plain, atol=0.1) and not torch.equal(low, plain)


# Tiny runs that save every 2 steps; 6 rows per batch split evenly over 1, 2 or 3 ranks.
RANKS_SMALL = ["--model=tiny", "--seq_len=32", "--global_batch_size=6"]
RANKS_SMALL += ["--device_microbatch_size=2", "--vocab_size=512", "--max_duration=6ba"]
RANKS_SMALL += ["--eval_interval=2ba", "--eval_batches=2", "--save_interval=2ba"]
RANKS_SMALL += ["--dist_timeout=60", "--save_num_checkpoints_to_keep=0", "--lr=3e-3"]


def torchrun(project: Path, workdir: Path, ranks: int, *args: str) -> None:
    import subprocess
    import sys

    from projects import checkout_env

    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launch += [f"--nproc_per_node={ranks}", str(project / "train.py"), "--device=cpu"]
    env = {**checkout_env(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launch, *RANKS_SMALL, *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def logged(workdir: Path, run: str, after: int = 0) -> list[tuple[int, str, float]]:
    """(step, key, value) of the losses and accuracy a run logged after step `after`."""
    keys = ("loss", "val_loss", "mlm_accuracy")
    rows = read_metrics(workdir, run)
    return [
        (r["step"], k, r[k]) for r in rows if r["step"] > after for k in keys if k in r
    ]


def assert_same(values: list, expected: list, run: str) -> None:
    assert [v[:2] for v in values] == [e[:2] for e in expected], run
    for (step, key, value), (_, _, want) in zip(values, expected):
        assert value == pytest.approx(want, rel=1e-5, abs=1e-6), (run, step, key)


def test_fsdp_equals_one_process_and_resumes_elastically_from_2_to_3_to_1_ranks(
    project: Path, tmp_path: Path
) -> None:
    """The masked-LM loss normalisation on any world size: FSDP2 on 2 gloo ranks logs one
    process's losses (reduction order aside, as test_distributed.py); its step-2
    checkpoint resumes on 3 ranks, and that run's step-4 checkpoint on 1 process, each to
    the same steps as the uninterrupted single process."""
    one = run_train(project, tmp_path, "--run_name=one", *RANKS_SMALL)
    assert one.returncode == 0, one.stderr
    reference = logged(tmp_path, "one")
    torchrun(project, tmp_path, 2, "--run_name=two", "--parallelism=fsdp")
    assert_same(logged(tmp_path, "two"), reference, "two")
    step_2 = tmp_path / "runs" / "two" / "checkpoints" / "step-2"
    torchrun(project, tmp_path, 3, "--run_name=three", f"--load_path={step_2}")
    assert_same(logged(tmp_path, "three", 2), logged(tmp_path, "one", 2), "three")
    step_4 = tmp_path / "runs" / "three" / "checkpoints" / "step-4"
    last = run_train(
        project, tmp_path, "--run_name=last", f"--load_path={step_4}", *RANKS_SMALL
    )
    assert last.returncode == 0, last.stderr
    assert_same(logged(tmp_path, "last", 4), logged(tmp_path, "one", 4), "last")


@pytest.mark.slow
def test_ddp_on_two_ranks_equals_one_process(project: Path, tmp_path: Path) -> None:
    """DDP's gradient average over 2 ranks with the factor world_size: one process's
    losses (FSDP2 checks the same normalisation in every run)."""
    one = run_train(project, tmp_path, "--run_name=one", *RANKS_SMALL)
    assert one.returncode == 0, one.stderr
    torchrun(project, tmp_path, 2, "--run_name=ddp", "--parallelism=ddp")
    assert_same(logged(tmp_path, "ddp"), logged(tmp_path, "one"), "ddp")


@pytest.mark.slow
def test_auto_microbatching_halves_on_out_of_memory_with_the_same_losses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mosaicbert with the out-of-memory search: an injected OOM above 4 samples halves
    the microbatch to 4, and the losses equal the run at 8 (the masked-token count of the
    global batch divides every microbatch's sum)."""
    project = tmp_path / "auto"
    result = scaffold_cli(
        "new",
        "--recipe",
        "mosaicbert",
        "--set",
        "auto_microbatching=true",
        str(project),
    )
    assert result.returncode == 0, result.stderr
    small = ["--model=tiny", "--seq_len=32", "--global_batch_size=8"]
    small += ["--vocab_size=512", "--max_duration=2ba", "--eval_batches=2"]
    whole = run_train(project, tmp_path, "--run_name=whole", *small)
    assert whole.returncode == 0, whole.stderr
    monkeypatch.setenv("SCAFFOLD_INJECT_OOM", "ranks=0;above=4;phase=backward")
    halved = run_train(project, tmp_path, "--run_name=halved", *small)
    assert halved.returncode == 0, halved.stderr
    rows = {
        run: json_rows(tmp_path / "runs" / run / "metrics.jsonl")
        for run in ("whole", "halved")
    }
    assert [r["microbatch_size"] for r in rows["whole"]] == [8, 8]
    assert [r["microbatch_size"] for r in rows["halved"]] == [4, 4]
    for a, b in zip(rows["whole"], rows["halved"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def json_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_sigusr1_saves_and_stops_and_a_rerun_continues_bitwise(
    project: Path, tmp_path: Path
) -> None:
    """Pre-emption on mosaicbert: SIGUSR1 mid-run saves after the current step and exits
    0; the same command resumes from that checkpoint, and the whole run's losses equal an
    uninterrupted run's bitwise (test_preempt.py checks SIGTERM under torchrun on GPT-2).
    """
    import signal
    import subprocess
    import sys
    import time

    from projects import checkout_env, read_metrics

    small = ["--model=tiny", "--seq_len=32", "--global_batch_size=8", "--lr=3e-3"]
    small += ["--vocab_size=512", "--max_duration=40ba", "--eval_interval=1000ba"]
    small += ["--save_interval=1000ba", "--eval_batches=1"]
    whole = run_train(project, tmp_path, "--run_name=whole", *small)
    assert whole.returncode == 0, whole.stderr
    command = [sys.executable, str(project / "train.py"), "--device=cpu", *small]
    command.append("--run_name=pre")
    first = subprocess.Popen(
        command, cwd=tmp_path, env=checkout_env(), stderr=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "runs" / "pre" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert first.poll() is None and time.monotonic() < deadline, "no steps"
        time.sleep(0.05)
    first.send_signal(signal.SIGUSR1)
    _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err[-3000:]
    log = (tmp_path / "runs" / "pre" / "log.txt").read_text()
    stopped = [
        line for line in log.splitlines() if "stopped by SIGUSR1 after step" in line
    ]
    assert stopped, log[-2000:]
    step = int(stopped[0].split("after step ")[1].split(",")[0])
    assert 3 <= step < 40
    second = subprocess.run(
        command, cwd=tmp_path, env=checkout_env(), capture_output=True, text=True
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in (tmp_path / "runs" / "pre" / "log.txt").read_text()
    losses = [(r["step"], r["loss"]) for r in read_metrics(tmp_path, "pre")]
    assert losses == [(r["step"], r["loss"]) for r in read_metrics(tmp_path, "whole")]
