"""Checkpoint storage: failures end in one line; checkpoints in object storage (S3 over HTTP).

- Local disks (root only: a real tmpfs is mounted): a disk that fills up in the middle of a
  save and a read-only mount end in one `error:` line naming the checkpoint, the path, the
  cause and the checkpoint a rerun resumes from, exit 1, on 1 and 2 ranks; with space again
  the same command resumes.
- S3: a real S3-compatible server process (moto's server mode) on 127.0.0.1, reached through a
  TCP relay the test can take down, by the real client (s3fs): save, rotate, resume, export,
  asynchronous save; wrong credentials; the store going away in the middle of an upload; a
  generated project killed (-9) inside a save and resumed from the bucket on another world size.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from projects import checkout_env, one_error_line, project_modules, read_metrics
from runtime import checkpoint
from runtime.time import Progress
from test_checkpoint import BATCHES_PER_EPOCH, build, same_params, state, train

TESTS = Path(__file__).resolve().parent
STOP_AFTER = TESTS / "stop_after.py"
SMALL = [
    "--device=cpu",
    "--seq_len=32",
    "--global_batch_size=12",
    "--device_microbatch_size=3",
    "--eval_batches=1",
    "--dist_timeout=120",
]


def launch(
    nproc: int, *args: object, cwd: Path, env: dict | None = None, timeout: int = 400
) -> subprocess.CompletedProcess[str]:
    prefix = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
        if nproc > 1
        else [sys.executable]
    )
    return subprocess.run(
        [*prefix, *map(str, args)],
        cwd=cwd,
        env={**checkout_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = Path(json.__file__).parent.parent
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(
        ((source / "argparse.py").read_text() + (source / "typing.py").read_text())[
            :150_000
        ]
    )
    return path


# ---------------------------------------------------------------- local disks


@pytest.fixture
def tmpfs(tmp_path: Path):
    """mount(size, read_only) -> a fresh tmpfs folder; unmounted afterwards. Root only."""
    mounted: list[Path] = []

    def mount(size: str, read_only: bool = False) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        where.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
            capture_output=True,
        ).returncode:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_full_disk_is_one_line_and_the_rerun_resumes(
    generated: dict[str, Path], tmp_path: Path, corpus: Path, tmpfs
) -> None:
    """The issue's case: a 16 MB tmpfs and ~10 MB checkpoints (the tiny preset). Step 1 fits,
    step 2 fills the disk mid-write: one line, exit 1, step 1 intact; with space, a rerun resumes.
    """
    disk = tmpfs("16m")
    train_py = generated["gpt2-baseline"] / "train.py"
    args = [
        train_py,
        *SMALL,
        f"--data={corpus}",
        "--max_duration=2ba",
        "--save_interval=1ba",
        "--eval_interval=2ba",
        "--save_num_checkpoints_to_keep=0",
        f"--save_folder={disk / 'ck'}",
        "--run_name=full",
    ]
    failed = launch(1, *args, cwd=tmp_path)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert error_lines(failed) == [
        f"error: checkpoint step-2 was not saved to {disk / 'ck' / 'step-2'}: No space left on device "
        f"[errno 28]; the checkpoints before it are intact: a rerun resumes from {disk / 'ck' / 'step-1'}"
    ]
    assert failed.stderr.strip().splitlines()[-1].startswith("error: checkpoint step-2")
    assert "Traceback" not in failed.stderr and "inline_container" not in failed.stderr
    assert checkpoint.latest(disk / "ck") == disk / "ck" / "step-1"

    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
    again = ok(launch(1, *args, cwd=tmp_path))
    assert f"resumed from {disk / 'ck' / 'step-1'} at step 1" in again.stdout
    assert [r["step"] for r in read_metrics(tmp_path, "full") if "loss" in r][-1] == 2


def test_read_only_mount_is_one_line_on_two_ranks(
    generated: dict[str, Path], tmp_path: Path, corpus: Path, tmpfs
) -> None:
    """A mount that turned read-only (as a vanished or remounted disk does): every rank stops
    with exit status 1 at the first save; rank 0 prints the one line."""
    disk = tmpfs("16m", read_only=True)
    train_py = generated["gpt2-baseline"] / "train.py"
    failed = launch(
        2,
        train_py,
        *SMALL,
        f"--data={corpus}",
        "--max_duration=1ba",
        f"--save_folder={disk / 'ck'}",
        "--run_name=ro",
        cwd=tmp_path,
    )
    assert failed.returncode != 0
    assert error_lines(failed) == [
        f"error: checkpoint step-1 was not saved to {disk / 'ck' / 'step-1'}: Read-only file system "
        f"[errno 30] ({disk / 'ck'}); a rerun starts from scratch (no complete checkpoint yet)"
    ]
    # torchrun's report: each rank exited with 1
    assert "exitcode  : 1" in failed.stderr, (
        failed.stdout[-2000:] + failed.stderr[-6000:]
    )
    assert (
        "RuntimeError" not in failed.stderr
        and "CheckpointException" not in failed.stderr
    )


# ---------------------------------------------------------------- an S3 server on 127.0.0.1


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Relay:
    """A TCP relay in front of the S3 server: `stop()` refuses connections and cuts the open
    ones (a store that goes away), `start()` brings it back with the server's data intact.
    """

    def __init__(self, target: int) -> None:
        self.target, self.port = target, free_port()
        self.server: socket.socket | None = None
        self.connections: list[socket.socket] = []
        self.start()

    def start(self) -> None:
        self.server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                return
            self.connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for sock in self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.connections.clear()


def start_moto(home: Path, enforce_auth: bool):
    """moto's S3 server (a separate process) on 127.0.0.1; yields (endpoint, credentials env).

    With `enforce_auth`, every request after the IAM set-up must be signed with a key that
    exists and is allowed: the environment's key may do anything in S3; the key in
    READ_ONLY_ACCESS_KEY_ID / READ_ONLY_SECRET_ACCESS_KEY may only read and list. (The
    checkpoint tests run on a server that accepts any key.)"""
    import boto3

    port = free_port()
    base = {
        "AWS_CONFIG_FILE": str(home / "config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials"),
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    extra = {"INITIAL_NO_AUTH_ACTION_COUNT": "6"} if enforce_auth else {}
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env={**os.environ, **base, **extra},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert (
                    time.monotonic() < deadline and server.poll() is None
                ), "moto server did not start"
                time.sleep(0.2)
        endpoint = f"http://127.0.0.1:{port}"
        key = {
            "AccessKeyId": "scaffold-test-key",
            "SecretAccessKey": "scaffold-test-secret-d41d8cd98f",
        }
        readers = {}
        if enforce_auth:  # the first 6 requests are let through unsigned: two IAM users
            iam = boto3.client(
                "iam",
                endpoint_url=endpoint,
                aws_access_key_id="setup",
                aws_secret_access_key="setup",
                region_name="us-east-1",
            )
            key = iam_user(iam, "ci", "s3:*")
            reader = iam_user(iam, "reader", ["s3:GetObject", "s3:ListBucket"])
            readers = {
                "READ_ONLY_ACCESS_KEY_ID": reader["AccessKeyId"],
                "READ_ONLY_SECRET_ACCESS_KEY": reader["SecretAccessKey"],
            }
        env = {
            **base,
            "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
            "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
            **readers,
        }
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        ).create_bucket(Bucket="ckpt")
        yield port, env
    finally:
        server.terminate()
        server.wait(30)


def iam_user(
    iam, name: str, actions: str | list[str]
) -> dict[str, str]:  # noqa: ANN001
    """A user allowed `actions` on every resource; its new access key."""
    iam.create_user(UserName=name)
    statement = {"Effect": "Allow", "Action": actions, "Resource": "*"}
    policy = {"Version": "2012-10-17", "Statement": [statement]}
    iam.put_user_policy(
        UserName=name, PolicyName="s3", PolicyDocument=json.dumps(policy)
    )
    return iam.create_access_key(UserName=name)["AccessKey"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """The S3 server behind a relay; the environment a client needs (credentials only there)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    for port, env in start_moto(tmp_path_factory.mktemp("aws"), enforce_auth=False):
        relay = Relay(port)
        yield {
            "env": {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{relay.port}"},
            "relay": relay,
        }
        relay.stop()


@pytest.fixture(scope="module")
def s3_auth(tmp_path_factory: pytest.TempPathFactory):
    """A second server that checks request signatures."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    for port, env in start_moto(tmp_path_factory.mktemp("aws"), enforce_auth=True):
        yield {"env": {**env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}}


@pytest.fixture
def s3_env(s3: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    import s3fs

    for name, value in s3["env"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SCAFFOLD_STAGING", str(tmp_path / "staging"))
    s3fs.S3FileSystem.clear_instance_cache()  # a client made with other credentials
    yield s3
    s3fs.S3FileSystem.clear_instance_cache()


def listing(url: str) -> dict[str, list[str]]:
    remote = checkpoint.storage.Remote(url)
    remote.fs.invalidate_cache()
    return {
        path.rsplit("/", 1)[-1]: sorted(
            p.rsplit("/", 1)[-1] for p in remote.fs.ls(path, detail=False)
        )
        for _, path in remote.steps()
    }


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_s3_save_rotate_resume_export(
    s3_env: dict, tmp_path: Path, async_save: bool
) -> None:
    url = f"s3://ckpt/unit-{'async' if async_save else 'sync'}"
    model, optimizer = build()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    checkpointer = checkpoint.Checkpointer(url, keep=2, async_save=async_save)
    assert checkpointer.resume(state(model, optimizer, progress)) is None
    for _ in range(3):
        train(model, optimizer, progress, 1)
        saved = checkpointer.save(state(model, optimizer, progress))
    checkpointer.close()
    assert saved == f"{url}/step-3"
    files = listing(url)
    assert sorted(files) == [
        "step-2",
        "step-3",
    ]  # rotation deleted step-1 in the bucket
    assert files["step-3"] == sorted(
        [
            ".metadata",
            "COMPLETE",
            "__0_0.distcp",
            "__0_1.distcp",
            "rng-rank0.pt",
            "train_state.json",
        ]
    )
    assert not any((tmp_path / "staging").rglob("*.distcp"))  # staged files are removed

    loaded, loaded_optimizer = build(seed=1)
    again = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    reader = checkpoint.Checkpointer(url, keep=2)
    resumed = reader.resume(state(loaded, loaded_optimizer, again))
    assert resumed is not None and resumed.path == f"{url}/step-3" and again.batch == 3
    assert same_params(loaded, model)
    assert resumed.describe() == [f"resumed from {url}/step-3 at step 3"]

    info = checkpoint.export_safetensors(url, tmp_path / "model.safetensors")
    assert info["checkpoint"] == f"{url}/step-3" and info["step"] == 3
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())


def test_s3_wrong_credentials_is_one_line(
    s3_auth: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An unknown key at the start, a wrong secret at a save: one line, the secret in neither."""
    import s3fs

    for name, value in s3_auth["env"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SCAFFOLD_STAGING", str(tmp_path / "staging"))
    model, optimizer = build()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    train(model, optimizer, progress, 1)
    checkpoint.Checkpointer("s3://ckpt/creds").save(
        state(model, optimizer, progress)
    )  # the right key works

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(checkpoint.CheckpointError) as raised:
        checkpoint.Checkpointer("s3://ckpt/creds").resume(
            state(model, optimizer, progress)
        )
    assert str(raised.value) == (
        "cannot read checkpoints in s3://ckpt/creds: ClientError: An error occurred (403) when calling the "
        f"HeadObject operation: Forbidden ({REFUSED})"
    )

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_auth["env"]["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    s3fs.S3FileSystem.clear_instance_cache()
    train(model, optimizer, progress, 1)
    with pytest.raises(checkpoint.StorageError) as raised:
        checkpoint.Checkpointer("s3://ckpt/creds").save(
            state(model, optimizer, progress)
        )
    assert str(raised.value) == (
        "checkpoint step-2 was not saved to s3://ckpt/creds/step-2: ClientError: An error occurred "
        f"(403) when calling the HeadObject operation: Forbidden ({REFUSED}); a rerun "
        "starts from scratch (no complete checkpoint yet)"
    )
    s3fs.S3FileSystem.clear_instance_cache()
    for secret in ("not-the-secret", s3_auth["env"]["AWS_SECRET_ACCESS_KEY"]):
        assert secret not in str(raised.value)


REFUSED = (
    "the store refused: check the credentials in its usual environment variables or "
    "config files, and their permissions on this URL"
)


@pytest.fixture
def s3_auth_env(s3_auth: dict, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The signature-checking server's environment, set here; s3fs's cached clients dropped."""
    import s3fs

    for name, value in s3_auth["env"].items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield s3_auth["env"]
    s3fs.S3FileSystem.clear_instance_cache()


def test_store_problems_are_one_line_naming_the_url_and_what_to_check(
    s3_auth_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What setup() asks before a run writes anything: the save folder listed and written
    to (the probe deleted), a load_path resolved; data URLs read through runtime.shards.
    A wrong secret, a read-only key, a missing bucket, an endpoint that does not answer:
    one line each, naming the URL and what to check, the secret in none."""
    import s3fs

    from runtime import shards

    def use(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()

    assert checkpoint.check_access("s3://ckpt/fine") is None
    assert objects("ckpt/fine", s3_auth_env) == []  # the probe is gone
    model, optimizer = build()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    train(model, optimizer, progress, 1)
    monkeypatch.setenv("SCAFFOLD_STAGING", str(tmp_path / "staging"))
    checkpoint.Checkpointer("s3://ckpt/pre").save(state(model, optimizer, progress))
    assert checkpoint.check_access("", "s3://ckpt/pre") is None

    use(AWS_SECRET_ACCESS_KEY="not-the-secret")
    wrong = (
        "ClientError: An error occurred (403) when calling the HeadObject operation: "
        f"Forbidden ({REFUSED})"
    )
    assert (
        checkpoint.check_access("s3://ckpt/run")
        == f"save_folder=s3://ckpt/run: {wrong}"
    )
    assert (
        checkpoint.check_access("", "s3://ckpt/pre")
        == f"load_path=s3://ckpt/pre: {wrong}"
    )
    with pytest.raises(shards.ShardError) as raised:
        shards.read_meta("s3://ckpt/data")
    assert str(raised.value) == f"--data: cannot read s3://ckpt/data/meta.json: {wrong}"

    use(
        AWS_ACCESS_KEY_ID=s3_auth_env["READ_ONLY_ACCESS_KEY_ID"],
        AWS_SECRET_ACCESS_KEY=s3_auth_env["READ_ONLY_SECRET_ACCESS_KEY"],
    )
    assert checkpoint.check_access("", "s3://ckpt/pre") is None  # reading is allowed
    assert checkpoint.check_access("s3://ckpt/run") == (
        "save_folder=s3://ckpt/run: AccessDenied: An error occurred (AccessDenied) when "
        f"calling the PutObject operation: Access Denied ({REFUSED})"
    )

    use(**{k: s3_auth_env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    missing = (
        "An error occurred (NoSuchBucket) when calling the PutObject operation: The "
        "specified bucket does not exist (no such bucket: create it, or correct the URL)"
    )
    assert checkpoint.check_access("s3://nobucket/run") == (
        f"save_folder=s3://nobucket/run: NoSuchBucket: {missing}"
    )

    # One attempt (botocore retries 3 times by default): the same line, sooner.
    use(AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}", AWS_MAX_ATTEMPTS="1")
    problem = checkpoint.check_access("s3://ckpt/run")
    assert problem.startswith(
        "save_folder=s3://ckpt/run: Connect call failed ("
    ), problem
    assert problem.endswith(
        "(the store does not answer: check its endpoint (AWS_ENDPOINT_URL for s3://, or "
        "the backend's config file) and the network)"
    )
    for secret in (s3_auth_env["AWS_SECRET_ACCESS_KEY"], "not-the-secret"):
        assert secret not in problem and secret not in str(raised.value)


def test_a_wrong_secret_or_a_read_only_key_stops_a_run_before_it_writes(
    generated: dict[str, Path],
    s3_auth_env: dict[str, str],
    corpus: Path,
    tmp_path: Path,
) -> None:
    """The issue's case: `--save_folder=s3://...` with a wrong AWS_SECRET_ACCESS_KEY, then
    with a key that may only read: each one `error:` line, exit 2, no runs/ folder, and
    nothing in the bucket."""
    args = [
        generated["gpt2-baseline"] / "train.py",
        *SMALL,
        f"--data={corpus}",
        "--max_duration=2ba",
        "--save_folder=s3://ckpt/refused",
    ]
    reader = {
        "AWS_ACCESS_KEY_ID": s3_auth_env["READ_ONLY_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": s3_auth_env["READ_ONLY_SECRET_ACCESS_KEY"],
    }
    for env, cause in (
        ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, "(403)"),
        (reader, "(AccessDenied) when calling the PutObject operation"),
    ):
        refused = launch(1, *args, cwd=tmp_path, env=env)
        line = one_error_line(refused, tmp_path)
        assert line.startswith("error: save_folder=s3://ckpt/refused: ")
        assert cause in line and line.endswith(f"({REFUSED})")
        assert objects("ckpt/refused", s3_auth_env) == []


def test_s3_damaged_newest_checkpoint_falls_back_and_is_replaced(
    s3_env: dict,
) -> None:
    """In a bucket as on disk: autoresume skips a damaged newest checkpoint (one note, the
    object kept), resumes the previous one, and the run's save of that step replaces it.
    """
    url = "s3://ckpt/damaged"
    model, optimizer = build()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    checkpointer = checkpoint.Checkpointer(url)
    train(model, optimizer, progress, 1)
    checkpointer.save(state(model, optimizer, progress))
    at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, optimizer, progress, 1)
    checkpointer.save(state(model, optimizer, progress))
    remote = checkpoint.storage.Remote(url)
    shard = remote.join("step-2", "__0_0.distcp")
    garbage = b"\0" * 64 + remote.fs.cat_file(shard)[64:]
    remote.fs.pipe_file(shard, garbage)

    again, again_optimizer = build(seed=1)
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    checkpointer = checkpoint.Checkpointer(url)
    resumed = checkpointer.resume(state(again, again_optimizer, progress))
    skipped, loaded = resumed.describe()
    assert skipped.startswith(f"skipped the damaged checkpoint {url}/step-2 (")
    assert "__0_0.distcp is unreadable" in skipped
    assert loaded == f"resumed from {url}/step-1 at step 1"
    assert all(torch.equal(again.state_dict()[k], v) for k, v in at_1.items())
    assert sorted(listing(url)) == ["step-1", "step-2"]
    assert remote.fs.cat_file(shard) == garbage  # kept

    train(again, again_optimizer, progress, 1)
    checkpointer.save(state(again, again_optimizer, progress))
    remote.fs.invalidate_cache()
    assert remote.fs.cat_file(shard) != garbage
    resumed = checkpoint.Checkpointer(url).resume(state(*build(seed=2), progress))
    assert resumed.describe() == [f"resumed from {url}/step-2 at step 2"]


def test_s3_store_gone_mid_upload(
    s3_env: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store goes away after the first file of step 2 was uploaded: one line naming the
    checkpoint, the URL, the cause and step 1; step 2 never looks complete; when the store is
    back, the next start deletes the partial step 2 and resumes from step 1."""
    url, relay = "s3://ckpt/gone", s3_env["relay"]
    model, optimizer = build()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    checkpointer = checkpoint.Checkpointer(url)
    train(model, optimizer, progress, 1)
    checkpointer.save(state(model, optimizer, progress))
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    put = checkpoint.storage.Remote.upload

    def upload_then_vanish(self, local, path, threads=8):  # noqa: ANN001, ANN202
        first = sorted(local.iterdir())[0]
        self.fs.put_file(str(first), f"{path}/{first.name}")
        relay.stop()
        return put(self, local, path, threads)

    monkeypatch.setattr(checkpoint.storage.Remote, "upload", upload_then_vanish)
    train(model, optimizer, progress, 1)
    try:
        with pytest.raises(checkpoint.StorageError) as raised:
            checkpointer.save(state(model, optimizer, progress))
    finally:
        relay.start()
    message = str(raised.value)
    assert message.startswith(
        f"checkpoint step-2 was not saved to {url}/step-2: "
    ), message
    assert "connect" in message.lower(), message
    assert message.endswith(
        f"the checkpoints before it are intact: a rerun resumes from {url}/step-1"
    )
    monkeypatch.undo()
    for name, value in s3_env["env"].items():
        monkeypatch.setenv(name, value)
    assert sorted(listing(url)) == [
        "step-1",
        "step-2",
    ]  # step-2: a partial upload, no marker

    loaded, loaded_optimizer = build(seed=1)
    again = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    resumed = checkpoint.Checkpointer(url).resume(
        state(loaded, loaded_optimizer, again)
    )
    assert resumed is not None and resumed.step == 1
    assert sorted(listing(url)) == ["step-1"]
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())


def test_generated_project_resumes_from_s3_after_kill_on_other_world_size(
    generated: dict[str, Path], tmp_path: Path, corpus: Path, s3: dict
) -> None:
    """`--save_folder=s3://ckpt/run`: 2 ranks, killed (-9) inside the save of step 3 (shards
    uploaded, no marker); a fresh machine (another working folder, nothing local) resumes on
    1 process from the bucket's step 2, rotates in the bucket and exports from it. Losses
    equal an uninterrupted 1-process run's; the secret key appears in no output or file.
    """
    train_py = generated["gpt2-baseline"] / "train.py"
    env = {**s3["env"], "SCAFFOLD_STAGING": str(tmp_path / "staging")}
    common = [
        *SMALL,
        f"--data={corpus}",
        "--max_duration=4ba",
        "--save_interval=1ba",
        "--eval_interval=4ba",
        "--save_num_checkpoints_to_keep=2",
        "--save_folder=s3://ckpt/run",
        "--run_name=s3",
    ]
    first, second = tmp_path / "node1", tmp_path / "node2"
    first.mkdir(), second.mkdir()
    killed = launch(2, STOP_AFTER, "kill:3", train_py, *common, cwd=first, env=env)
    assert killed.returncode != 0
    assert sorted(listing_env("s3://ckpt/run", env)) == ["step-1", "step-2", "step-3"]

    resumed = ok(launch(1, train_py, *common, cwd=second, env=env))
    assert (
        "resumed from s3://ckpt/run/step-2 at step 2 (saved on 2 rank(s), now 1)"
        in resumed.stdout
    )
    assert sorted(listing_env("s3://ckpt/run", env)) == [
        "step-3",
        "step-4",
    ]  # partial step-3 replaced

    local_args = [
        a for a in common if not a.startswith(("--save_folder", "--run_name"))
    ]
    reference = ok(launch(1, train_py, *local_args, "--run_name=ref", cwd=second))
    assert "done: step 4" in reference.stdout
    ours = {r["step"]: r["loss"] for r in read_metrics(second, "s3") if "loss" in r}
    ref = {r["step"]: r["loss"] for r in read_metrics(second, "ref") if "loss" in r}
    assert sorted(ours) == [3, 4]
    assert all(abs(ours[s] - ref[s]) < 1e-4 for s in ours), (
        ours,
        ref,
    )  # elastic: RNG re-seeded,
    # but dropout is 0 and the batch order is a function of the step: the same losses up to
    # the order of reductions (2 ranks -> 1)

    exported = subprocess.run(
        [
            sys.executable,
            "-c",
            "from scaffold.cli import main; main()",
            "export",
            "s3://ckpt/run",
            str(second / "out.safetensors"),
        ],
        cwd=second,
        capture_output=True,
        text=True,
        env={**checkout_env(), **env},
        timeout=300,
    )
    assert exported.returncode == 0, exported.stderr
    assert "from s3://ckpt/run/step-4 (step 4)" in exported.stdout
    # The same checkpoint as a Hugging Face GPT-2 folder: the run's config.toml names the preset.
    hf_exported = subprocess.run(
        [
            sys.executable,
            "-c",
            "from scaffold.cli import main; main()",
            "export",
            "--format",
            "hf",
            "s3://ckpt/run",
            str(second / "hf"),
            "--run-config",
            str(second / "runs" / "s3" / "config.toml"),
            "--project",
            str(train_py.parent),
        ],
        cwd=second,
        capture_output=True,
        text=True,
        env={**checkout_env(), **env},
        timeout=300,
    )
    assert hf_exported.returncode == 0, hf_exported.stderr
    assert "from s3://ckpt/run/step-4 (step 4)" in hf_exported.stdout
    from safetensors.torch import load_file

    transformers = pytest.importorskip("transformers")
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with project_modules(train_py.parent) as modules:
        m = modules["model"]
        model = m.GPT(
            m.GPTConfig(vocab_size=256, max_seq_len=32, **m.PRESETS["tiny"])
        ).eval()
        model.load_state_dict(load_file(second / "out.safetensors"))
        with torch.no_grad():
            ours = model(tokens)
            theirs = (
                transformers.GPT2LMHeadModel.from_pretrained(second / "hf")
                .eval()(tokens)
                .logits
            )
    assert (ours - theirs).abs().max().item() < 1e-5
    secret = env["AWS_SECRET_ACCESS_KEY"]
    for result in (killed, resumed, exported, hf_exported):
        assert secret not in result.stdout + result.stderr
    for folder in (first, second):
        assert not [
            p
            for p in folder.rglob("*")
            if p.is_file() and secret.encode() in p.read_bytes()
        ]


def listing_env(url: str, env: dict) -> dict[str, list[str]]:
    import s3fs

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        return listing(url)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        s3fs.S3FileSystem.clear_instance_cache()


def objects(prefix: str, env: dict[str, str]) -> list[str]:
    """Every object under `prefix` (bucket/path), listed with the environment's key."""
    import s3fs

    store = s3fs.S3FileSystem(
        endpoint_url=env["AWS_ENDPOINT_URL"],
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        skip_instance_cache=True,
    )
    return store.find(prefix)
