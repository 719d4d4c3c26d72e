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

`SlurmCluster.start(folder, cpus=1, nodes=2)` starts nodes n1, n2, ... on this machine: a
bridge holds the controller's address (10.231.P.1, P from the pid), each node's slurmd runs in a
network namespace of its own joined to it by a veth pair (10.231.P.2, .3, ...), with its own
hostname (the node name) and its own /etc/hosts (a bind mount private to its mount namespace)
naming every node. Needs root and `ip`, `nsenter`, `unshare`; `stop()` removes the namespaces
and the bridge after the daemons. KillWait is `kill_wait` (30 s, SLURM's default) and
OverTimeLimit 0: a job past its `--time` gets SIGTERM, then SIGKILL 30 s later.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
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
    cpus: int  # per node
    nodes: int = 1
    # Seconds between SIGTERM and SIGKILL at a job's end (time limit, scancel).
    kill_wait: int = 30
    env: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    network: list[list[str]] = field(
        default_factory=list
    )  # `ip` commands undoing setup

    @classmethod
    def start(
        cls, folder: Path, cpus: int | None = None, nodes: int = 1
    ) -> SlurmCluster:
        folder.mkdir(parents=True, exist_ok=True)
        for parent in [
            folder,
            *folder.parents,
        ]:  # munge's socket must be reachable by all
            if parent.stat().st_mode & 0o005 != 0o005:
                parent.chmod(parent.stat().st_mode | 0o755)
        cluster = cls(folder, cpus or os.cpu_count() or 1, nodes)
        try:
            cluster._write_config()
            cluster._start_daemons()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    @property
    def node_names(self) -> list[str]:
        if self.nodes == 1:
            return [socket.gethostname().split(".")[0]]
        return [f"n{i}" for i in range(1, self.nodes + 1)]

    @property
    def subnet(self) -> str:
        """The bridge's /24 (several nodes): .1 the controller, .2, .3, ... the nodes."""
        return f"10.231.{os.getpid() % 250}"

    def _ip(self, *args: str, undo: list[str] | None = None) -> None:
        if undo:
            self.network.append(undo)
        result = subprocess.run(["ip", *args], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")

    def _netns(self, node: str) -> str:
        return f"scaffold-{os.getpid()}-{node}"

    def _build_network(self) -> None:
        """A bridge (the controller's address) and, per node, a network namespace joined to
        it by a veth pair (`scaf0` inside) and a hosts file naming every node."""
        bridge = f"scb{os.getpid()}"[:15]
        self._ip("link", "add", bridge, "type", "bridge", undo=["link", "del", bridge])
        self._ip("addr", "add", f"{self.subnet}.1/24", "dev", bridge)
        self._ip("link", "set", bridge, "up")
        host = socket.gethostname().split(".")[0]  # the controller's
        hosts = f"127.0.0.1 localhost\n{self.subnet}.1 {host}\n" + "".join(
            f"{self.subnet}.{i + 2} {name}\n" for i, name in enumerate(self.node_names)
        )
        for i, name in enumerate(self.node_names):
            ns, outside = self._netns(name), f"scv{os.getpid()}{name}"[:15]
            self._ip("netns", "add", ns, undo=["netns", "del", ns])
            self._ip("link", "add", outside, "type", "veth", "peer", "name", "scaf0")
            self._ip("link", "set", "scaf0", "netns", ns)
            self._ip("link", "set", outside, "master", bridge, "up")
            self._ip(
                "-n", ns, "addr", "add", f"{self.subnet}.{i + 2}/24", "dev", "scaf0"
            )
            self._ip("-n", ns, "link", "set", "scaf0", "up")
            self._ip("-n", ns, "link", "set", "lo", "up")
            (self.folder / f"hosts-{name}").write_text(hosts)

    def _write_config(self) -> None:
        f = self.folder
        for sub in ("state", "spool", "munge"):
            (f / sub).mkdir(exist_ok=True)
        (f / "munge").chmod(0o755)
        key = f / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        host = socket.gethostname().split(".")[0]
        names = self.node_names
        if self.nodes == 1:  # slurmd on this host
            nodes = f"NodeName={host} CPUs={self.cpus} State=UNKNOWN"
            slurmd = f"""SlurmdPidFile={f}/slurmd.pid
SlurmdLogFile={f}/slurmd.log
SlurmdSpoolDir={f}/spool"""
        else:  # one slurmd per network namespace, all on the same port
            self._build_network()
            nodes = "\n".join(
                f"NodeName={name} NodeAddr={self.subnet}.{i + 2} CPUs={self.cpus}"
                " State=UNKNOWN"
                for i, name in enumerate(names)
            )
            slurmd = f"""SlurmctldAddr={self.subnet}.1
SlurmdPidFile={f}/slurmd-%n.pid
SlurmdLogFile={f}/slurmd-%n.log
SlurmdSpoolDir={f}/spool/%n"""
            for name in names:
                (f / "spool" / name).mkdir(exist_ok=True)
        (f / "slurm.conf").write_text(f"""ClusterName=scaffoldtest
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={f}/munge/munge.sock,cred_expire=5
SlurmUser=root
SlurmdUser=root
StateSaveLocation={f}/state
SlurmctldPidFile={f}/slurmctld.pid
SlurmctldLogFile={f}/slurmctld.log
{slurmd}
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
KillWait={self.kill_wait}
OverTimeLimit=0
{nodes}
PartitionName=debug Nodes={",".join(names)} Default=YES MaxTime=INFINITE State=UP
""")
        self.env = {**os.environ, "SLURM_CONF": str(f / "slurm.conf")}

    def _spawn(self, name: str, *args: str, prefix: tuple[str, ...] = ()) -> None:
        log = open(self.folder / f"{name}.out", "w")
        process = subprocess.Popen(
            [*prefix, _program(name.split(":")[0]), *args],
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
        if self.nodes == 1:
            self._spawn("slurmd", "-D")
        for name in self.node_names if self.nodes > 1 else []:
            # Inside the node's namespace: its own hostname and /etc/hosts (a private
            # bind mount: this machine's /etc is not changed); exec keeps slurmd's pid.
            # (nsenter, not `ip netns exec`: that mounts a new /sys, without cgroups.)
            prefix = ["nsenter", f"--net=/run/netns/{self._netns(name)}", "unshare"]
            prefix += ["--uts"]
            prefix += ["--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && ']
            prefix[-1] += 'hostname "$1" && shift && exec "$@"'
            prefix += [str(self.folder / f"hosts-{name}"), name]
            self._spawn(f"slurmd:{name}", "-D", "-N", name, prefix=tuple(prefix))
        log = "slurmd.log" if self.nodes == 1 else f"slurmd-{self.node_names[-1]}.log"
        self._until(self._nodes_idle, "the nodes to come up idle", log)

    def _nodes_idle(self) -> bool:
        out = self._run("sinfo", "-h", "-N", "-o", "%t").stdout.split()
        return len(out) == self.nodes and all(s.startswith("idle") for s in out)

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

    def cancel(self, job_id: int) -> None:
        """`scancel JOB`: SIGTERM to every process of the job, SIGKILL KillWait s later."""
        result = self._run("scancel", str(job_id))
        assert result.returncode == 0, result.stderr

    def log_times(self, pattern: str, log: str = "slurmctld.log") -> list[float]:
        """When (epoch seconds) the daemon logged each line matching `pattern`."""
        text = (self.folder / log).read_text()
        return [
            datetime.fromisoformat(stamp).timestamp()
            for stamp in re.findall(rf"^\[([^\]]+)\] .*{pattern}", text, re.MULTILINE)
        ]

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
        daemons = [n for n in self.pids if n.startswith("slurmd")]
        for name in [*daemons, "slurmctld", "munged"]:
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
        while self.network:  # namespaces, then the bridge (veth pairs go with them)
            subprocess.run(["ip", *self.network.pop()], capture_output=True)

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
