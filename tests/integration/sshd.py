"""A throw-away OpenSSH server on 127.0.0.1 for the ssh runner's tests.

``start_sshd(tmp)`` finds ``sshd`` (installing openssh-server with apt-get when it is missing and
we are root), makes a host key and a client key in ``tmp``, starts ``sshd -D`` on a free port
with a config that only accepts that client key, and returns how to reach it. Nothing outside
``tmp`` is configured; the server is stopped by its process id.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


class SshdUnavailable(RuntimeError):
    """sshd is not installed and cannot be installed here (the reason is the message)."""


@dataclass
class Sshd:
    process: subprocess.Popen
    port: int
    client_key: Path
    log: Path

    def ssh_options(self) -> list[str]:
        return [
            "-i",
            str(self.client_key),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
        ]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def find_or_install_sshd() -> str:
    for candidate in (shutil.which("sshd"), "/usr/sbin/sshd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SshdUnavailable("sshd is not installed and this is not a root apt-get machine to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "openssh-server"]
    done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:  # a fresh image may have no package lists yet
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, timeout=600, check=False)
        done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0 or not os.access("/usr/sbin/sshd", os.X_OK):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SshdUnavailable(f"apt-get install openssh-server failed: {tail[0]}")
    return "/usr/sbin/sshd"


def start_sshd(directory: Path) -> Sshd:
    sshd = find_or_install_sshd()
    keygen = shutil.which("ssh-keygen")
    if keygen is None or shutil.which("ssh") is None:
        raise SshdUnavailable("the ssh client (ssh, ssh-keygen) is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    host_key, client_key = directory / "host_ed25519", directory / "client_ed25519"
    for key in (host_key, client_key):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True, capture_output=True)
    authorized = directory / "authorized_keys"
    authorized.write_text(client_key.with_suffix(".pub").read_text())
    authorized.chmod(0o600)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation directory (Debian)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = directory / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {host_key}\nAuthorizedKeysFile {authorized}\n"
        f"PidFile {directory / 'sshd.pid'}\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\n"
        "PrintMotd no\nLogLevel ERROR\n"
    )
    log = directory / "sshd.log"
    process = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=log.open("w"))
    server = Sshd(process, port, client_key, log)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SshdUnavailable(f"sshd exited at start: {log.read_text().strip()[-300:]}")
        probe = subprocess.run(
            ["ssh", "-p", str(port), *server.ssh_options(), "127.0.0.1", "true"],
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
        if probe.returncode == 0:
            return server
        time.sleep(0.3)
    server.stop()
    raise SshdUnavailable(f"could not log in to the test sshd: {probe.stderr.strip()[-300:]}")
