"""A real one-node SLURM cluster (munge, slurmctld, slurmd) in a temporary folder, for the tests.

    with SlurmCluster.start(folder) as cluster:
        job = cluster.sbatch(["scripts/slurm.sbatch", "--max_duration=8ba"], cwd=project)
        cluster.wait(job)

Everything (config, state, sockets, logs) lives under `folder`, reached through `SLURM_CONF`;
nothing in /etc is touched. Facts this relies on (slurm 22.05, munge 0.5.15): the node name must
equal `hostname -s`; every folder above munge's socket must be searchable by all; a requeued job
is held ~145 s unless credentials expire fast (`cred_expire=5`) and the scheduler runs every
second; killing slurmd leaves job processes running, so `stop()` cancels every job and waits for
an empty queue before stopping the daemons by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")


def missing() -> str | None:
    """Why a cluster cannot start here (a program not installed), or None."""
    for name in DAEMONS:
        if shutil.which(name) is None and not Path("/usr/sbin", name).exists():
            return f"SLURM is not installed ({name} not found; .ci/run installs it as root)"
    if os.geteuid() != 0:
        return "the test SLURM cluster runs its daemons as root; not root here"
    return None


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class SlurmCluster:
    folder: Path
    cpus: int
    env: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(cls, folder: Path, cpus: int | None = None) -> SlurmCluster:
        folder.mkdir(parents=True, exist_ok=True)
        for parent in [
            folder,
            *folder.parents,
        ]:  # munge's socket must be reachable by all
            if parent.stat().st_mode & 0o005 != 0o005:
                parent.chmod(parent.stat().st_mode | 0o755)
        cluster = cls(folder, cpus or os.cpu_count() or 1)
        cluster._write_config()
        try:
            cluster._start_daemons()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _write_config(self) -> None:
        f = self.folder
        for sub in ("state", "spool", "munge"):
            (f / sub).mkdir(exist_ok=True)
        (f / "munge").chmod(0o755)
        key = f / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        node = socket.gethostname().split(".")[0]
        (f / "slurm.conf").write_text(f"""ClusterName=scaffoldtest
SlurmctldHost={node}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={f}/munge/munge.sock,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd.pid
SlurmctldLogFile={f}/slurmctld.log
SlurmdLogFile={f}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
MinJobAge=300
NodeName={node} CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
        self.env = {**os.environ, "SLURM_CONF": str(f / "slurm.conf")}

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.folder / f"{name}.out", "w")
        process = subprocess.Popen(
            [_program(name), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self.pids[name] = process.pid

    def _start_daemons(self) -> None:
        m = self.folder / "munge"
        self._spawn(
            "munged",
            "-F",
            "--force",
            f"--key-file={m}/munge.key",
            f"--socket={m}/munge.sock",
            f"--pid-file={m}/munged.pid",
            f"--log-file={m}/munged.log",
            f"--seed-file={m}/munged.seed",
        )
        self._until(
            lambda: (m / "munge.sock").exists(), "munged's socket", "munge/munged.log"
        )
        self._spawn("slurmctld", "-D", "-i")
        self._until(
            lambda: self._run("scontrol", "ping").returncode == 0,
            "slurmctld",
            "slurmctld.log",
        )
        self._spawn("slurmd", "-D")
        self._until(self._node_idle, "the node to come up idle", "slurmd.log")

    def _node_idle(self) -> bool:
        out = self._run("sinfo", "-h", "-o", "%t").stdout.strip()
        return out.startswith("idle")

    def _until(self, ready, what: str, log: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, pid in self.pids.items():
                if _exited(pid):
                    raise RuntimeError(
                        f"{name} exited while waiting for {what}: {self._tail(log)}"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}: {self._tail(log)}")
            time.sleep(0.1)

    def _tail(self, log: str) -> str:
        path = self.folder / log
        return path.read_text()[-2000:] if path.exists() else f"({log} not written)"

    def _run(
        self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
    ):
        return subprocess.run(
            [_program(args[0]), *args[1:]],
            capture_output=True,
            text=True,
            cwd=cwd,
            env={**self.env, **(env or {})},
            timeout=60,
        )

    # ------------------------------------------------------------------ for the tests

    def sbatch(
        self, args: list[str], cwd: Path, env: dict[str, str] | None = None
    ) -> int:
        result = self._run("sbatch", "--parsable", *args, cwd=cwd, env=env)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self._run("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_state(
        self, job_id: int, states: tuple[str, ...], timeout: float = 240.0
    ) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} not in {states} after {timeout} s: {info}"
                )
            time.sleep(0.2)

    def wait(self, job_id: int, timeout: float = 240.0) -> dict[str, str]:
        return self.wait_state(
            job_id,
            ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
            timeout,
        )

    def signal_batch(self, job_id: int, sig: str = "USR1") -> None:
        result = self._run("scancel", f"--signal={sig}", "--batch", str(job_id))
        assert result.returncode == 0, result.stderr

    def stop(self) -> None:
        """Cancel every job, wait for an empty queue, then stop the daemons by pid."""
        if self.pids.get("slurmctld") and not _exited(self.pids["slurmctld"]):
            self._run("scancel", "--full", "--user=root")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                out = self._run("squeue", "-h", "-t", "all", "-o", "%i %T")
                live = [
                    line
                    for line in out.stdout.splitlines()
                    if "COMPLET" not in line
                    and "CANCELLED" not in line
                    and "FAILED" not in line
                ]
                if out.returncode != 0 or not live:
                    break
                time.sleep(0.2)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None or _exited(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not _exited(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if not _exited(pid):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _exited(pid: int) -> bool:
    """True once `pid` (a child of this process) has exited; reaps it."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == pid
