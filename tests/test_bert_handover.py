"""Pretrain -> fine-tune (README's commands): a `mosaicbert` run (ALiBi, GeGLU, unpadding,
low-precision LayerNorm) exports its encoder in the bert pack's own layout, and a
`mosaicbert-sst2` project (the bert pack with the same ALiBi and GeGLU) loads it with
--model=FOLDER, every encoder tensor unchanged, and fine-tunes it; a project without them
refuses the folder in one line. A run whose algorithms keep BERT's layout exports a
BertForMaskedLM folder, which transformers loads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from conftest import scaffold_cli  # noqa: E402
from projects import project_modules, read_metrics, run_train  # noqa: E402


def new(dest: Path, recipe: str, *sets: str) -> Path:
    made = scaffold_cli(
        "new", "--recipe", recipe, *[f"--set={s}" for s in sets], str(dest)
    )
    assert made.returncode == 0, made.stderr
    return dest


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """mosaicbert pretrained 2 steps, exported as README says; the checkpoint's weights."""
    from runtime.checkpoint import export

    root = tmp_path_factory.mktemp("handover")
    project = new(root / "bert-pre", "mosaicbert")
    small = ["--seq_len=32", "--global_batch_size=8", "--vocab_size=512"]
    result = run_train(project, root, *small, "--max_duration=2ba", "--eval_batches=1")
    assert result.returncode == 0, result.stderr
    out = root / "bert-pre-enc"
    done = scaffold_cli(
        "export", "--format", "hf", str(root / "runs" / "bert-pre"), str(out),
        "--project", str(project),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    weights, _, _, _ = export.read_weights(str(root / "runs" / "bert-pre"))
    return out, weights


def test_mosaicbert_export_fine_tunes_in_the_bert_pack_with_the_encoder_unchanged(
    exported: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every encoder tensor of the checkpoint (the masked-LM head left behind) is the
    fine-tune model's, bit for bit; 20 steps on the offline set beat the majority
    label's share of the validation set."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, weights = exported
    project = new(tmp_path / "sst2", "mosaicbert-sst2")
    with project_modules(project) as found:
        tokenizer = found["model"].load_tokenizer(str(out), [])
        torch.manual_seed(0)
        model = found["model"].load_model(str(out), 2, tokenizer, 32)
        texts = found["data"].load_texts("", "", "", "label", 0, 42)
    handed = model.encoder.state_dict()
    encoder = {k for k in weights if not k.startswith("head_")}
    assert set(handed) == encoder and "wpe.weight" not in encoder  # ALiBi: no table
    for name, tensor in handed.items():
        assert torch.equal(tensor, weights[name]), name
    labels = texts.val.labels
    chance = np.bincount(labels).max() / len(labels)
    tuned = run_train(
        project, tmp_path, f"--model={out}", "--run_name=ft", "--max_seq_len=32",
        "--global_batch_size=16", "--max_duration=20ba", "--eval_interval=20ba",
        "--lr=3e-3",
    )  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr
    accuracy = [r["accuracy"] for r in read_metrics(tmp_path, "ft") if "accuracy" in r]
    assert accuracy and accuracy[-1] > chance + 0.05, (accuracy, chance)


def test_an_export_without_the_runs_tokenizer_is_one_line(
    exported: tuple[Path, dict], tmp_path: Path
) -> None:
    """Without the run's tokenizer there is nothing to fine-tune with: refused in one
    line, exit 2, nothing written."""
    root = exported[0].parent
    saved = root / "runs" / "bert-pre" / "tokenizer"
    saved.rename(tmp_path / "moved")
    try:
        done = scaffold_cli(
            "export", "--format", "hf", str(root / "runs" / "bert-pre"),
            str(tmp_path / "no-tok"), "--project", str(root / "bert-pre"),
        )  # fmt: skip
    finally:
        (tmp_path / "moved").rename(saved)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no saved tokenizer beside the run" in lines[0], lines
    assert not (tmp_path / "no-tok").exists()


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["model_family=bert"], "its encoder was pretrained with gated_linear_units ("),
        ([], "an encoder `scaffold export` wrote in the bert pack's own layout"),
    ],
    ids=["bert-pack-without-alibi-and-glu", "hf-pack"],
)
def test_a_project_without_the_exports_algorithms_refuses_it_in_one_line(
    exported: tuple[Path, dict],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    sets: list[str],
    message: str,
) -> None:
    """bert-sst2 on the bert pack (BERT's layout) and on the hf pack: train.main() in
    this process exits 2 with one error line naming the fix, and writes no run."""
    project = new(tmp_path / "sst2", "bert-sst2", *sets)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        "sys.argv", ["train.py", "--device=cpu", f"--model={exported[0]}"]
    )
    capsys.readouterr()
    with project_modules(project) as found:
        try:
            with pytest.raises(SystemExit) as exited:
                found["train"].main()
        finally:
            found["train"].dist.shutdown()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: --model={exported[0]}: {message}"), lines[0]
    assert "scaffold new --recipe mosaicbert-sst2" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_an_export_in_berts_layout_is_a_bert_for_masked_lm_transformers_fine_tunes(
    tmp_path: Path,
) -> None:
    """bert-pretrain-baseline's model.py maps its weights to BertForMaskedLM
    (`to_hf_bert`, what `scaffold export --format hf` writes for it): transformers'
    logits equal ours at every real token, and a sequence classifier loaded from the
    folder holds the same encoder."""
    project = new(tmp_path / "pre", "bert-pretrain-baseline")
    with project_modules(project) as found:
        model_py = found["model"]
        config = model_py.EncoderConfig(64, 16, pad_id=0, **model_py.PRESETS["tiny"])
        torch.manual_seed(0)
        encoder = model_py.Encoder(config).eval()
        hf_config, hf_weights = model_py.to_hf_bert(encoder.state_dict(), config)
    hf = transformers.BertForMaskedLM(transformers.BertConfig(**hf_config))
    loaded = hf.load_state_dict(hf_weights, strict=False)
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    assert all("position_ids" in k or "decoder" in k for k in loaded.missing_keys)
    hf.save_pretrained(tmp_path / "hf")
    hf.eval()
    ids = torch.tensor([[2, 7, 9, 11, 3], [2, 8, 3, 0, 0]])
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=ids != 0).logits
        real = (ids != 0).flatten().nonzero()[:, 0]  # flat positions, as train.py's
        expected = encoder(ids, real)  # the head at every real token
    assert torch.allclose(logits[ids != 0], expected, atol=1e-4)
    classifier = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", num_labels=2
    )
    handed = classifier.bert.state_dict()
    for name, tensor in hf.bert.state_dict().items():
        if not name.startswith("pooler"):  # the classifier's pooler is new
            assert torch.equal(handed[name], tensor), name
