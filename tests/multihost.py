"""Two "hosts" on one machine: two network namespaces joined by a veth pair, each with its own
address and (through `unshare --uts`) its own hostname. As far as torch.distributed, torchrun
and slurmd are concerned they are two nodes; `tc` on the veth makes the link between them
slower than the link inside a node, as in a cluster.

    with TwoHosts() as hosts:                 # or the `two_hosts` fixture of the tests
        agents = hosts.torchrun(["-m", "mpoverlap.train", ...], nproc_per_node=2)
        ...
    # namespaces, agents and workers are gone here, also when the body raised

Names carry this process's pid and a random suffix, so a leftover of a crashed run never
clashes with the next one; `remove_stale()` deletes the leftovers whose creator is dead.
Everything runs on addresses inside the namespaces: nothing reaches another network.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

PREFIX = "mpoh"  # every namespace this harness makes: mpoh<pid>-<hex>-h<i>
SUBNET = "10.233.0"  # private, and only ever seen inside the two namespaces
BIN = Path(sys.executable).parent


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> Optional[str]:
    """None when this machine can make the two hosts, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "two-host tests need root: network namespaces (ip netns add) and unshare --uts"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"two-host tests need the `{tool}` command"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here (ip netns add: {made.stderr.strip()})"
    _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Delete namespaces of this harness whose creating process no longer exists."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _kill_namespace(name)


def _kill_namespace(name: str) -> None:
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", name, check=False)


class TwoHosts:
    """Hosts h0 (SUBNET.1) and h1 (SUBNET.2). `names[i]` is host i's hostname."""

    def __init__(self, tag: Optional[str] = None) -> None:
        self.tag = tag or f"{os.getpid()}-{secrets.token_hex(3)}"
        self.netns = [f"{PREFIX}{self.tag}-h{i}" for i in range(2)]
        self.names = [f"node{i}-{self.tag.split('-')[-1]}" for i in range(2)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(2)]
        self._veth = [f"mv{self.tag.split('-')[-1]}{c}" for c in "ab"]  # <= 15 characters
        self._procs: List[subprocess.Popen] = []

    # ---- the network ----------------------------------------------------------------
    def __enter__(self) -> "TwoHosts":
        remove_stale()
        try:
            for ns in self.netns:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            a, b = self._veth
            _ip("link", "add", a, "netns", self.netns[0], "type", "veth", "peer", "name", b, "netns", self.netns[1])
            for ns, dev, addr in zip(self.netns, self._veth, self.addrs):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
            self._write_hosts_file()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_hosts_file(self) -> None:
        """`ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts: each host then
        resolves both hostnames (torchrun and gloo look the peers' names up)."""
        lines = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.addrs, self.names))
        for ns in self.netns:
            d = Path("/etc/netns") / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(lines)

    def slow_link(self, rate: str = "200mbit") -> None:
        """Rate-limit the veth both ways (tbf: netem is not available here)."""
        for ns, dev in zip(self.netns, self._veth):
            _ip("netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", "64kb", "latency", "100ms")

    def fast_link(self) -> None:
        for ns, dev in zip(self.netns, self._veth):
            _ip("netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)

    # ---- processes ------------------------------------------------------------------
    def popen(self, host: int, argv: Sequence[str], env: Optional[Dict[str, str]] = None, **kwargs) -> subprocess.Popen:
        """Run argv on host `host`: in its namespace, under its own hostname, in a session of
        its own (so that the whole tree can be signalled and cleaned up)."""
        wrapped = ["ip", "netns", "exec", self.netns[host], "unshare", "--uts", "sh", "-c",
                   f'hostname {self.names[host]} && exec "$@"', "sh", *argv]
        proc = subprocess.Popen(wrapped, env=env, start_new_session=True, text=True, **kwargs)
        self._procs.append(proc)
        return proc

    def torchrun(self, module_args: Sequence[str], nproc_per_node: int = 2, port: int = 29400,
                 env: Optional[Dict[str, str]] = None, log_dir: Optional[Path] = None) -> List[subprocess.Popen]:
        """One torchrun agent per host over a c10d rendezvous on host 0; stdout and stderr of
        agent i go to log_dir/agent{i}.out|err when log_dir is given, else to pipes."""
        env = dict(os.environ if env is None else env)
        env.pop("RANK", None)
        env.setdefault("OMP_NUM_THREADS", "1")
        agents = []
        for i in range(2):
            argv = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", str(nproc_per_node),
                    "--node-rank", str(i), "--rdzv-backend", "c10d", "--rdzv-id", self.tag,
                    "--rdzv-endpoint", f"{self.names[0]}:{port}", "--max-restarts", "0",
                    "--monitor-interval", "0.5", *module_args]
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                out, err = open(log_dir / f"agent{i}.out", "w"), open(log_dir / f"agent{i}.err", "w")
            else:
                out = err = subprocess.PIPE
            agents.append(self.popen(i, argv, env=env, stdout=out, stderr=err))
        return agents

    def pids(self, host: int) -> List[int]:
        """Every process running in host `host`'s namespace."""
        return [int(p) for p in _ip("netns", "pids", self.netns[host], check=False).stdout.split()]

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in self.netns:
            _kill_namespace(ns)  # workers that left the session (none should) die with it
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
