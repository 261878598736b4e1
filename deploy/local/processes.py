"""Start and stop the services as local processes (the demo, end-to-end tests, the SLURM launcher).

Each process runs in its own session so that stopping it also stops its children (torchrun's
ranks, vLLM's engine core); `Cluster` stops everything it started, newest first, on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from syncd import http_client
from syncd.auth import ENV_TOKEN_FILE, write_token_file

PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the whole process group, wait until every member (not just the leader: vLLM's
        engine core, torchrun's ranks) is gone, and SIGKILL what is left after `grace_s`."""
        pgid = self.popen.pid
        if not group_members(pgid):
            self.popen.poll()
            return
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while group_members(pgid) and time.monotonic() < deadline:
            self.popen.poll()  # reap the leader so it does not linger as a zombie
            time.sleep(0.1)
        if group_members(pgid):
            _signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


@dataclass
class Cluster:
    """Processes started for one run, all stopped by `stop()` (also used as a context manager)."""

    logs: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Proc:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        # Appended, with a header per start: a service restarted under the same name (syncd in the
        # restart tests) keeps the log of its previous life, which is where a failure's cause is.
        with open(log, "a") as out:  # the child keeps its own copy of the descriptor
            out.write(f"==== {time.strftime('%H:%M:%S')} start: {' '.join(cmd)}\n")
            out.flush()
            popen = subprocess.Popen(
                cmd,
                cwd=REPO,
                env={**self.env, **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def make_token(self, directory: Path) -> str:
        """A fresh syncd token in `directory`/auth-token (mode 0600), handed to every process this
        cluster starts from now on as SYNCD_AUTH_TOKEN_FILE: its path, never the token, so it
        shows on no command line. Returns the token, for this process's own calls to syncd."""
        path = directory / "auth-token"
        path.unlink(missing_ok=True)
        token = write_token_file(path)
        self.env[ENV_TOKEN_FILE] = str(path)
        return token

    def wait_http(
        self,
        proc: Proc,
        url: str,
        timeout_s: float,
        ok=lambda r: r.status_code == 200,
        finished_ok: bool = False,
    ) -> None:
        """Wait until `url` answers `ok`; fail fast (with the log tail) if `proc` exits first,
        unless `finished_ok` and it exited with status 0 (it did its work before the wait saw it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not proc.alive():
                if finished_ok and proc.popen.returncode == 0:
                    return
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            try:
                if ok(http_client.get(url, timeout=5)):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{proc.name} not ready at {url} after {timeout_s:.0f} s:\n{proc.tail()}")

    def discard(self, proc: Proc) -> None:
        """Stop `proc` now and forget it: a process that ends before the others (a test's reference
        generator, a replica killed on purpose, a syncd restarted)."""
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
