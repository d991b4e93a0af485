"""Real PostgreSQL, MariaDB, Apache Kafka (KRaft), ZooKeeper and RabbitMQ on loopback, for the
demo, the tests, CI and the benchmarks.

Contract:
  * `up` installs what is missing (Debian packages, Maven Central jars resolved into a cache),
    then starts every service with its data under the scratch directory (default
    `target/services`, moved with OUTBOX_SERVICES_DIR), bound to 127.0.0.1 on ports of our own,
    and waits with a deadline until each one answers a real request. Running `up` again while
    the services run is a no-op.
  * `env` prints `export NAME=value` lines; tests, the demo and the benchmarks read only these.
  * `down` stops only the processes `up` started, by the pid it recorded.
  * `status` shows each service, its pid, its port and whether it answers.
  * A PostgreSQL streaming standby (`postgres-standby`) and a MariaDB GTID replica
    (`mariadb-replica`) start only when named, each cloned from its primary at that moment;
    `promote` turns one into a primary, and `down` of one throws its data away (the next `up`
    clones the primary again).

Nothing here touches a system-wide service: packages are installed with service start-up
suppressed, and every server runs from a data directory under the scratch directory.
"""

from __future__ import annotations

import base64
import os
import pwd
import secrets
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
IS_ROOT = os.geteuid() == 0


def traversable_by_service_users(path: Path) -> bool:
    """As root, the servers run as `postgres`, `mysql` and `rabbitmq`; they must reach their data."""
    if not IS_ROOT:
        return True
    for user in ("postgres", "mysql", "rabbitmq"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            continue  # not installed yet; checked again once it is
        probe = subprocess.run(["runuser", "-u", user, "--", "test", "-x", str(path)], capture_output=True)
        if probe.returncode != 0:
            return False
    return True


def default_state() -> Path:
    """`target/services` in the checkout, unless a parent directory is closed to the service
    users (a checkout under a 0700 directory): then a stable directory under /tmp named after
    the checkout, so `up`, `env` and `down` agree."""
    preferred = ROOT / "target" / "services"
    if traversable_by_service_users(ROOT):
        return preferred
    import hashlib
    tag = hashlib.sha256(str(ROOT).encode()).hexdigest()[:10]
    return Path(f"/tmp/outbox-services-{tag}")


def resolve_state() -> Path:
    if os.environ.get("OUTBOX_SERVICES_DIR"):
        return Path(os.environ["OUTBOX_SERVICES_DIR"]).resolve()
    return default_state()


# Resolved in main(), after `up` installed the packages that create the service users.
STATE = ROOT / "target" / "services"
CACHE = Path(os.environ.get("OUTBOX_SERVICES_CACHE", Path.home() / ".cache" / "outbox-streamer")).resolve()
PG_BIN = Path("/usr/lib/postgresql/15/bin")
START_DEADLINE_S = float(os.environ.get("OUTBOX_SERVICES_DEADLINE", "90"))
STOP_DEADLINE_S = 30.0


def port(var: str, default: int) -> int:
    raw = os.environ.get(var, str(default))
    try:
        return int(raw)
    except ValueError:
        fail(f"{var}={raw!r} is not a port number; unset it or give a number such as {default}")


PG_PORT = port("OUTBOX_PG_PORT", 25432)
MYSQL_PORT = port("OUTBOX_MYSQL_PORT", 23306)
# The failover tests' standby and replica: started only when named, next to their primary.
PG_STANDBY_PORT = port("OUTBOX_PG_STANDBY_PORT", PG_PORT + 1)
MYSQL_REPLICA_PORT = port("OUTBOX_MYSQL_REPLICA_PORT", MYSQL_PORT + 1)
KAFKA_PORT = port("OUTBOX_KAFKA_PORT", 29092)
KAFKA_CONTROLLER_PORT = port("OUTBOX_KAFKA_CONTROLLER_PORT", 29093)
# A second listener that requires SASL (SCRAM-SHA-256 or PLAIN) as user KAFKA_SASL_USER.
KAFKA_SASL_PORT = port("OUTBOX_KAFKA_SASL_PORT", 29094)
KAFKA_SASL_USER = "outbox"
# A third listener with TLS (the private CA's server certificate; client certificates optional).
KAFKA_TLS_PORT = port("OUTBOX_KAFKA_TLS_PORT", 29095)
ZK_PORT = port("OUTBOX_ZK_PORT", 22181)
# ZooKeeper's TLS client port (Netty), with the private CA's server certificate.
ZK_TLS_PORT = port("OUTBOX_ZK_TLS_PORT", 22182)
# RabbitMQ (AMQP 0-9-1) and its TLS listener. Not 25672: that is RabbitMQ's own convention for
# the distribution port of a node on 5672. Erlang distribution and its port mapper (epmd) get
# ports of our own too, so a system RabbitMQ (5672, 25672, epmd on 4369) or another copy of the
# services on other ports never meets this one.
RABBITMQ_PORT = port("OUTBOX_RABBITMQ_PORT", 25673)
RABBITMQ_TLS_PORT = port("OUTBOX_RABBITMQ_TLS_PORT", 25674)
RABBITMQ_DIST_PORT = port("OUTBOX_RABBITMQ_DIST_PORT", 25675)
RABBITMQ_EPMD_PORT = port("OUTBOX_RABBITMQ_EPMD_PORT", 25676)


class ServiceError(Exception):
    pass


def fail(msg: str) -> None:
    print(f"scripts/services: error: {msg}", file=sys.stderr)
    sys.exit(1)


def say(msg: str) -> None:
    print(f"scripts/services: {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, text=True, capture_output=True, **kw)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log written yet)"


# ---------------------------------------------------------------- secrets

def password(name: str) -> str:
    """A random password made on first use and kept in the state directory (mode 0600)."""
    path = STATE / "secrets" / name
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    value = secrets.token_urlsafe(18)
    path.write_text(value + "\n")
    os.chmod(path, 0o600)
    return value


# ---------------------------------------------------------------- install

def apt_install(packages: list[str]) -> None:
    if not IS_ROOT:
        fail(f"missing packages {' '.join(packages)}; run `sudo apt-get install {' '.join(packages)}` or run this as root")
    say(f"installing {' '.join(packages)} from Debian packages (system services stay stopped)")
    policy = Path("/usr/sbin/policy-rc.d")
    made_policy = False
    if not policy.exists():
        # Debian's hook for "do not start services from maintainer scripts".
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        made_policy = True
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        lists = Path("/var/lib/apt/lists")
        if not any(lists.glob("*Packages*")):
            subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
        result = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], env=env)
        if result.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], check=True, env=env)
            subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages], check=True, env=env)
    finally:
        if made_policy:
            policy.unlink()
    # Packages may have started their system service despite the policy (non-Debian init);
    # they are not ours to stop, but they must not hold our ports, which are not defaults.
    # (Erlang programs that appear during the install are stopped by install(): stop_system_erlang.)


# Erlang's programs: the VM, its port programs, and epmd (which detaches from whoever started it).
ERLANG_PROGRAMS = ("beam.smp", "epmd", "erl_child_setup", "inet_gethost")


def erlang_processes() -> set[int]:
    """Pids of running Erlang programs that are not ours (see `Service.helpers`)."""
    found = set()
    for pid in all_pids():
        if comm(pid) in ERLANG_PROGRAMS and alive(pid) and service_of(pid) is None:
            found.add(pid)
    return found


def stop_system_erlang(before: set[int]) -> None:
    """Stops a system RabbitMQ and epmd that installing the packages started.

    rabbitmq-server's postinst runs `invoke-rc.d rabbitmq-server start` (and erlang-base's offers
    to start every installed service that depends on Erlang); invoke-rc.d asks policy-rc.d first,
    and apt_install's policy-rc.d (exit 101, Debian's "no start-ups now") makes it refuse, so with
    no systemd nothing starts. A policy-rc.d of the system's own that allows start-ups would let a
    system RabbitMQ (on 5672, 25672) and epmd (on 4369) run: the ones that appeared during this
    install (Erlang programs without our OUTBOX_SERVICES_OWNER mark) are stopped here."""
    new = sorted(erlang_processes() - before)
    if not new:
        return
    say(f"stopping the system RabbitMQ/epmd the package install started (pids {', '.join(map(str, new))})")
    terminate(new)


def java_major() -> int:
    java = shutil.which("java")
    if not java:
        return 0
    out = run([java, "-version"]).stderr
    for token in out.replace('"', " ").split():
        if token[:2].isdigit() or token[:1].isdigit():
            head = token.split(".")[0]
            if head == "1":
                return int(token.split(".")[1])
            if head.isdigit():
                return int(head)
    return 0


def install() -> None:
    missing = []
    if not (PG_BIN / "postgres").exists():
        missing += ["postgresql-15", "postgresql-client-15"]
    if not shutil.which("psql"):
        missing.append("postgresql-client-15")
    if not (Path("/usr/sbin/mariadbd").exists() and shutil.which("mariadb-install-db")):
        missing += ["mariadb-server", "mariadb-client"]
    if java_major() < 17:
        missing.append("openjdk-17-jre-headless")
    if not shutil.which("mvn"):
        missing.append("maven")
    if not shutil.which("openssl"):
        missing.append("openssl")
    if not (RABBITMQ_BIN / "rabbitmq-server").exists():
        missing.append("rabbitmq-server")
    if missing:
        before = erlang_processes()
        apt_install(sorted(set(missing)))
        stop_system_erlang(before)
    for name in ("kafka", "zookeeper"):
        classpath(name)


def classpath(name: str) -> str:
    """The runtime classpath of `name`, resolved once with Maven into CACHE and reused offline."""
    pom = HERE / f"{name}.pom.xml"
    out = CACHE / f"{name}.classpath"
    stamp = CACHE / f"{name}.pom.sha"
    digest = str(hash_file(pom))
    if out.exists() and stamp.exists() and stamp.read_text() == digest:
        cp = out.read_text().strip()
        if cp and all(Path(p).exists() for p in cp.split(":")):
            return cp
    CACHE.mkdir(parents=True, exist_ok=True)
    say(f"resolving {name} jars from Maven Central into {CACHE / 'maven'}")
    result = run(["mvn", "-q", "-B", "-f", str(pom), f"-Dmaven.repo.local={CACHE / 'maven'}",
                  "dependency:build-classpath", f"-Dmdep.outputFile={out}"])
    if result.returncode != 0:
        fail(f"maven could not resolve {name} ({pom}):\n{result.stdout[-3000:]}{result.stderr[-2000:]}")
    stamp.write_text(digest)
    return out.read_text().strip()


def hash_file(path: Path) -> str:
    import hashlib
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- process handling

@dataclass
class Service:
    name: str
    port: int
    port_var: str
    prepare: Callable[[], None]
    command: Callable[[], list[str]]
    check: Callable[[], str | None]  # None when ready, else why not
    run_as: str | None = None
    stop_signal: int = signal.SIGTERM
    # What a crash is: no shutdown work at all (PostgreSQL: its immediate shutdown, SIGQUIT,
    # which ends the server's processes without a checkpoint, so the next start recovers).
    crash_signal: int = signal.SIGKILL
    after_ready: Callable[[], None] | None = None
    # Started only when named (`up postgres-standby`); its data goes with `down`.
    disposable: bool = False
    # The server's environment on top of ours (and of OWNER_VAR, which every service gets).
    env: Callable[[], dict[str, str]] | None = None
    # Its server starts helpers that detach and outlive it (RabbitMQ's epmd): `stop` ends them
    # too, found by the OWNER_VAR they inherit, also when an earlier `up` started them.
    helpers: bool = False

    @property
    def dir(self) -> Path:
        return STATE / self.name

    @property
    def pidfile(self) -> Path:
        return self.dir / "pid"

    @property
    def log(self) -> Path:
        return self.dir / f"{self.name}.log"

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            return None
        if stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
            return None  # exited; its parent has not reaped it yet
        if not cmdline:
            return pid  # between fork and exec (or a launcher re-exec): still ours
        # The pid is ours only while it runs a command that names our directory (pids are reused).
        return pid if str(self.dir) in cmdline else None


# Set to the service's directory in the environment of every server we start; its children
# inherit it, so a helper that detached from the server is still known as ours.
OWNER_VAR = "OUTBOX_SERVICES_OWNER"


def all_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def comm(pid: int) -> str:
    """The program name of process `pid` ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def service_of(pid: int) -> str | None:
    """The service directory in the OWNER_VAR of process `pid` (None: not ours, or unreadable)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = f"{OWNER_VAR}=".encode()
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def helper_pids(svc: Service) -> list[int]:
    """Processes of `svc` other than its server (and this script): its detached helpers."""
    if not svc.helpers:
        return []
    skip = (os.getpid(), svc.pid())
    return [p for p in all_pids() if p not in skip and alive(p) and service_of(p) == str(svc.dir)]


def terminate(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL for what still runs after `grace_s`."""
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for p in pids:
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def port_free(p: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", p))
            return True
        except OSError:
            return False


def user_ids(name: str | None):
    if not IS_ROOT or name is None:
        return None
    entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


def chown_tree(path: Path, owner: str | None) -> None:
    ids = user_ids(owner)
    if ids is None:
        return
    for dirpath, dirnames, filenames in os.walk(path):
        os.chown(dirpath, *ids)
        for f in filenames:
            os.chown(os.path.join(dirpath, f), *ids)


def check_reachable(svc: Service) -> None:
    """A server running as another user must be able to reach its directory."""
    ids = user_ids(svc.run_as)
    if ids is None:
        return
    probe = run(["runuser", "-u", svc.run_as, "--", "test", "-w", str(svc.dir)])
    if probe.returncode != 0:
        raise ServiceError(
            f"{svc.name}: user {svc.run_as!r} cannot write {svc.dir}; a parent directory is not "
            f"traversable. Set OUTBOX_SERVICES_DIR to a directory it can reach, e.g. /tmp/outbox-services")


def start(svc: Service) -> None:
    if svc.pid() is not None:
        return
    if not port_free(svc.port):
        raise ServiceError(
            f"{svc.name}: port {svc.port} on 127.0.0.1 is already in use by another process; "
            f"set {svc.port_var} to a free port (and use the same value for every scripts/services call)")
    svc.dir.mkdir(parents=True, exist_ok=True)
    chown_tree(svc.dir, svc.run_as)
    check_reachable(svc)
    svc.prepare()
    chown_tree(svc.dir, svc.run_as)
    ids = user_ids(svc.run_as)
    env = dict(os.environ, **(svc.env() if svc.env else {}), **{OWNER_VAR: str(svc.dir)})
    with open(svc.log, "ab") as log:
        log.write(f"\n==== started by scripts/services at {time.ctime()} ====\n".encode())
        log.flush()
        proc = subprocess.Popen(
            svc.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=svc.dir, start_new_session=True, env=env,
            user=ids[0] if ids else None, group=ids[1] if ids else None,
            extra_groups=[] if ids else None)
    svc.pidfile.write_text(f"{proc.pid}\n")


def wait_ready(svc: Service, deadline: float) -> None:
    last = "not started"
    while time.monotonic() < deadline:
        if svc.pid() is None:
            time.sleep(0.5)  # confirm, and let a dying process's last words reach the log
            if svc.pid() is not None:
                continue
            raise ServiceError(f"{svc.name} exited during start-up; log {svc.log}:\n{tail(svc.log)}")
        try:
            why = svc.check()
        except OSError as e:
            why = str(e)
        if why is None:
            if svc.after_ready:
                svc.after_ready()
            return
        last = why
        time.sleep(0.2)
    raise ServiceError(
        f"{svc.name} did not answer within {START_DEADLINE_S:.0f}s (last check: {last}); "
        f"log {svc.log}:\n{tail(svc.log)}")


def stop(svc: Service, sig: int | None = None) -> None:
    """Sends `sig` (the service's stop signal by default) and waits; SIGKILL after the deadline."""
    pid = svc.pid()
    if pid is None:
        svc.pidfile.unlink(missing_ok=True)
        stop_helpers(svc)
        return
    os.kill(pid, svc.stop_signal if sig is None else sig)
    deadline = time.monotonic() + STOP_DEADLINE_S
    while time.monotonic() < deadline and svc.pid() is not None:
        time.sleep(0.1)
    if svc.pid() is not None:
        say(f"{svc.name} (pid {pid}) did not stop within {STOP_DEADLINE_S:.0f}s; sending SIGKILL")
        os.killpg(pid, signal.SIGKILL)
    svc.pidfile.unlink(missing_ok=True)
    stop_helpers(svc)


def stop_helpers(svc: Service) -> None:
    """Ends what the server left running (RabbitMQ's epmd), once the server itself is gone."""
    left = helper_pids(svc)
    if left:
        names = [f"{comm(p) or '?'} (pid {p})" for p in left]
        say(f"{svc.name:<9} stopping its helper{'s' if len(left) > 1 else ''} {', '.join(names)}")
        terminate(left)


# ---------------------------------------------------------------- TLS

def tls_dir() -> Path:
    return STATE / "tls"


def openssl(args: list[str]) -> None:
    r = run(["openssl", *args])
    if r.returncode != 0:
        raise ServiceError(f"openssl {args[0]} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def tls_material() -> None:
    """A private CA and the certificates the TLS listeners and the tests use, made once under
    tls_dir(): server.pem/.key for 127.0.0.1 and localhost, client.pem/.key with CN
    outbox_cert_client (PostgreSQL `cert` authentication), and other-ca.pem, a CA that signed
    nothing here (the tests' wrong CA). Keys are unencrypted PKCS#8 P-256."""
    d = tls_dir()
    if (d / "complete").exists():
        return
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for ca in ("ca", "other-ca"):
        openssl(["req", "-x509", *ec, "-days", "3650", "-subj", f"/CN=outbox-streamer test {ca}",
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
                 "-keyout", str(d / f"{ca}.key"), "-out", str(d / f"{ca}.pem")])
    for name, cn, san in (("server", "localhost", "IP:127.0.0.1,DNS:localhost"),
                          ("client", "outbox_cert_client", "DNS:outbox_cert_client")):
        ext = d / f"{name}.ext"
        ext.write_text(f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\n"
                       "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n")
        openssl(["req", "-new", *ec, "-subj", f"/CN={cn}", "-keyout", str(d / f"{name}.key"),
                 "-out", str(d / f"{name}.csr")])
        openssl(["x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                 "-CAcreateserial", "-days", "3650", "-extfile", str(ext), "-out", str(d / f"{name}.pem")])
    # Kafka and ZooKeeper read the key and its certificate from one PEM file.
    (d / "server-bundle.pem").write_text((d / "server.key").read_text() + (d / "server.pem").read_text())
    for f in d.iterdir():
        os.chmod(f, 0o600 if f.suffix == ".key" or f.name == "server-bundle.pem" else 0o644)
    (d / "complete").write_text("")


def tls_copy(service_dir: Path, names: list[str]) -> Path:
    """Copies TLS files into a service's own directory (servers insist on owning their key)."""
    target = service_dir / "tls"
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(tls_dir() / name, target / name)
        os.chmod(target / name, 0o600)
    return target


# ---------------------------------------------------------------- PostgreSQL

PG_USER = "outbox_admin"


def pg_prepare() -> None:
    data = STATE / "postgres" / "data"
    tls_copy(STATE / "postgres", ["server.pem", "server.key", "ca.pem"])
    if not (data / "PG_VERSION").exists():
        pg_init(data)
    # Rewritten at every start: role groups whose members must use TLS, or a client certificate.
    with open(data / "pg_hba.conf", "w") as hba:
        hba.write("# outbox-streamer: TCP on loopback only, SCRAM passwords (scripts/services)\n")
        hba.write("# members of outbox_tls_required must connect with TLS\n")
        hba.write("hostnossl all +outbox_tls_required 127.0.0.1/32 reject\n")
        hba.write("hostnossl replication +outbox_tls_required 127.0.0.1/32 reject\n")
        hba.write("# members of outbox_cert_auth log in with a client certificate whose CN is their name\n")
        hba.write("hostssl all +outbox_cert_auth 127.0.0.1/32 cert\n")
        hba.write("hostssl replication +outbox_cert_auth 127.0.0.1/32 cert\n")
        hba.write("host all all 127.0.0.1/32 scram-sha-256\n")
        hba.write("host replication all 127.0.0.1/32 scram-sha-256\n")


def pg_init(data: Path) -> None:
    pwfile = STATE / "postgres" / "initdb.pw"
    pwfile.write_text(password("postgres") + "\n")
    chown_tree(STATE / "postgres", "postgres")
    cmd = [str(PG_BIN / "initdb"), "-D", str(data), "-U", PG_USER, f"--pwfile={pwfile}",
           "--auth=scram-sha-256", "--encoding=UTF8", "--locale=C.UTF-8"]
    if IS_ROOT:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    result = run(cmd)
    pwfile.unlink()
    if result.returncode != 0:
        raise ServiceError(f"postgres: initdb failed:\n{result.stdout}{result.stderr}")
    with open(data / "postgresql.conf", "a") as conf:
        conf.write("\n# outbox-streamer test/demo settings (scripts/services)\n")
        for line in [
            "listen_addresses = '127.0.0.1'",
            "unix_socket_directories = ''",
            "wal_level = logical",
            "max_replication_slots = 64",
            "max_wal_senders = 64",
            "track_commit_timestamp = on",
            "max_connections = 300",
            "shared_buffers = 256MB",
            "logical_decoding_work_mem = 64MB",
            "log_min_messages = warning",
            "log_line_prefix = '%m [%p] %q%u@%d '",
        ]:
            conf.write(line + "\n")


def pg_command(name: str = "postgres", pg_port: int = PG_PORT, sync_names: str = "outbox_standby") -> list[str]:
    tls = STATE / name / "tls"
    return [str(PG_BIN / "postgres"), "-D", str(STATE / name / "data"), "-p", str(pg_port),
            "-c", "ssl=on", "-c", f"ssl_cert_file={tls / 'server.pem'}", "-c", f"ssl_key_file={tls / 'server.key'}",
            "-c", f"ssl_ca_file={tls / 'ca.pem'}",
            # Two-phase transactions (PREPARE TRANSACTION) are part of the tested workload.
            "-c", "max_prepared_transactions=16",
            # Test slots are dropped when the next test process starts; a full run needs more
            # than 64 of them at once.
            "-c", "max_replication_slots=256", "-c", "max_wal_senders=128",
            # The standby is synchronous for the sessions that ask (`SET synchronous_commit =
            # on`: the failover tests' writers); every other session commits locally, as it
            # would with no standby at all.
            "-c", f"synchronous_standby_names={sync_names}", "-c", "synchronous_commit=local"]


PG_STANDBY_NAME = "outbox_standby"


def psql(sql: str, db: str = "postgres", pg_port: int = PG_PORT) -> subprocess.CompletedProcess:
    return run(["psql", "-X", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", str(pg_port), "-U", PG_USER,
                "-d", db, "-Atc", sql], env=dict(os.environ, PGPASSWORD=password("postgres"), PGCONNECT_TIMEOUT="2"))


def pg_check() -> str | None:
    r = psql("SHOW wal_level")
    if r.returncode != 0:
        return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "psql failed"
    if r.stdout.strip() != "logical":
        return f"wal_level is {r.stdout.strip()!r}, expected 'logical'"
    return None


def pg_standby_prepare() -> None:
    """A fresh base backup of the running primary, set to stream from it as PG_STANDBY_NAME."""
    base = STATE / "postgres-standby"
    tls_copy(base, ["server.pem", "server.key", "ca.pem"])
    data = base / "data"
    if (data / "PG_VERSION").exists():
        return
    if pg_check() is not None:
        raise ServiceError("postgres-standby: the primary (postgres) must run first: scripts/services up postgres")
    shutil.rmtree(data, ignore_errors=True)
    chown_tree(base, "postgres")
    cmd = [str(PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(PG_PORT), "-U", PG_USER, "-D", str(data),
           "-X", "stream", "--checkpoint=fast", "--no-sync"]
    if IS_ROOT:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    r = run(cmd, env=dict(os.environ, PGPASSWORD=password("postgres")))
    if r.returncode != 0:
        raise ServiceError(f"postgres-standby: pg_basebackup failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    conninfo = (f"host=127.0.0.1 port={PG_PORT} user={PG_USER} password={password('postgres')} "
                f"application_name={PG_STANDBY_NAME}")
    with open(data / "postgresql.auto.conf", "a") as conf:
        conf.write(f"primary_conninfo = '{conninfo}'\n")
    (data / "standby.signal").write_text("")
    os.chmod(data, 0o700)


def pg_standby_check() -> str | None:
    r = psql("SELECT 1", pg_port=PG_STANDBY_PORT)
    if r.returncode != 0:
        return r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "psql failed"
    return None


def pg_standby_promote() -> None:
    r = psql("SELECT pg_promote(true, 60)", pg_port=PG_STANDBY_PORT)
    if r.returncode != 0 or r.stdout.strip() != "t":
        raise ServiceError(f"postgres-standby: promotion failed: {r.stdout.strip()} {r.stderr.strip()}")


# ---------------------------------------------------------------- MariaDB

MYSQL_USER = "outbox_admin"


def mysql_sock(name: str = "mariadb") -> Path:
    return STATE / name / "mysqld.sock"


def mysql_prepare(name: str = "mariadb") -> None:
    data = STATE / name / "data"
    (STATE / name / "binlog").mkdir(parents=True, exist_ok=True)
    tls_copy(STATE / name, ["server.pem", "server.key", "ca.pem"])
    if (data / "mysql").exists():
        return
    data.mkdir(parents=True, exist_ok=True)
    chown_tree(STATE / name, "mysql")
    socket_user = "root" if IS_ROOT else pwd.getpwuid(os.geteuid()).pw_name
    cmd = ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--auth-root-authentication-method=socket",
           f"--auth-root-socket-user={socket_user}", "--skip-test-db"]
    if IS_ROOT:
        cmd.append("--user=mysql")
    result = run(cmd)
    if result.returncode != 0:
        raise ServiceError(f"mariadb: mariadb-install-db failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


def mysql_command(name: str = "mariadb", my_port: int = MYSQL_PORT, server_id: int = 1) -> list[str]:
    base = STATE / name
    cmd = ["/usr/sbin/mariadbd", "--no-defaults", f"--datadir={base / 'data'}", f"--port={my_port}",
           "--bind-address=127.0.0.1", f"--socket={mysql_sock(name)}", f"--pid-file={base / 'mariadbd.pid'}",
           f"--log-bin={base / 'binlog' / 'mariadb-bin'}", f"--server-id={server_id}", "--binlog-format=ROW",
           "--binlog-row-image=FULL", "--binlog-row-metadata=FULL", "--sync-binlog=1",
           "--innodb-flush-log-at-trx-commit=1", "--gtid-strict-mode=ON", "--log-bin-compress=OFF",
           "--binlog-expire-logs-seconds=86400",
           "--max-connections=300", "--innodb-buffer-pool-size=256M", "--max-allowed-packet=64M",
           "--skip-name-resolve", "--character-set-server=utf8mb4", "--collation-server=utf8mb4_bin",
           f"--ssl-cert={base / 'tls' / 'server.pem'}", f"--ssl-key={base / 'tls' / 'server.key'}",
           f"--ssl-ca={base / 'tls' / 'ca.pem'}"]
    if IS_ROOT:
        cmd.append("--user=mysql")
    return cmd


def mysql_query(sql: str, admin: bool = True, name: str = "mariadb", my_port: int = MYSQL_PORT,
                headers: bool = False) -> subprocess.CompletedProcess:
    if admin:
        return run(["mariadb", "--no-defaults", "-h", "127.0.0.1", "-P", str(my_port), "-u", MYSQL_USER,
                    "--connect-timeout=2", *([] if headers else ["-N"]), "-B", "-e", sql],
                   env=dict(os.environ, MYSQL_PWD=password("mariadb")))
    return run(["mariadb", "--no-defaults", f"--socket={mysql_sock(name)}", "-u", "root", "--connect-timeout=2",
                "-N", "-B", "-e", sql])


def mysql_check() -> str | None:
    r = mysql_query("SELECT @@log_bin, @@binlog_format, @@binlog_row_image")
    if r.returncode != 0:
        # The admin user is created right after the first start; the root socket answers first.
        root = mysql_query("SELECT 1", admin=False)
        if root.returncode == 0:
            mysql_create_admin()
            r = mysql_query("SELECT @@log_bin, @@binlog_format, @@binlog_row_image")
        if r.returncode != 0:
            return (r.stderr.strip() or "mariadb client failed").splitlines()[-1]
    fields = r.stdout.split()
    if fields != ["1", "ROW", "FULL"]:
        return f"binlog settings are {fields}, expected log_bin=1 ROW FULL"
    return None


def mysql_create_admin(name: str = "mariadb", logged: bool = True) -> None:
    pw = password("mariadb").replace("'", "''")
    # A replica's own writes would give it transactions its primary never had.
    sql = ("" if logged else "SET SESSION sql_log_bin = 0; ") + (
           f"CREATE USER IF NOT EXISTS '{MYSQL_USER}'@'127.0.0.1' IDENTIFIED BY '{pw}'; "
           f"ALTER USER '{MYSQL_USER}'@'127.0.0.1' IDENTIFIED BY '{pw}'; "
           f"GRANT ALL PRIVILEGES ON *.* TO '{MYSQL_USER}'@'127.0.0.1' WITH GRANT OPTION;")
    r = mysql_query(sql, admin=False, name=name)
    if r.returncode != 0:
        raise ServiceError(f"{name}: could not create {MYSQL_USER}: {r.stderr.strip()}")


def mysql_replica_log_updates() -> str:
    """OUTBOX_MYSQL_REPLICA_LOG_UPDATES (ON by default), read when the replica starts."""
    value = os.environ.get("OUTBOX_MYSQL_REPLICA_LOG_UPDATES", "ON").upper()
    if value not in ("ON", "OFF"):
        fail(f"OUTBOX_MYSQL_REPLICA_LOG_UPDATES={value!r} must be ON or OFF")
    return value


def mysql_replica_command() -> list[str]:
    return [*mysql_command("mariadb-replica", MYSQL_REPLICA_PORT, 2),
            # ON: its binlog carries what it applies (the primary's GTIDs), so a streamer resumes
            # on it by GTID after a promotion. OFF (OUTBOX_MYSQL_REPLICA_LOG_UPDATES=OFF): its
            # binlog has only its own writes, so a stored position is not in it after a promotion.
            f"--log-slave-updates={mysql_replica_log_updates()}", "--read-only=ON",
            # Acknowledges the primary's commits when the primary asks (semi-sync, switched on
            # by the failover tests only).
            "--rpl-semi-sync-slave-enabled=ON",
            # It starts empty at the primary's position at that moment: writes to databases
            # made before it (other tests') find no table here and are skipped.
            "--slave-skip-errors=1049,1146"]


def mysql_replica_check() -> str | None:
    r = mysql_query("SELECT 1", my_port=MYSQL_REPLICA_PORT)
    if r.returncode != 0:
        root = mysql_query("SELECT 1", admin=False, name="mariadb-replica")
        if root.returncode == 0:
            mysql_create_admin("mariadb-replica", logged=False)
            r = mysql_query("SELECT 1", my_port=MYSQL_REPLICA_PORT)
        if r.returncode != 0:
            return (r.stderr.strip() or "mariadb client failed").splitlines()[-1]
    return None


def mysql_replica_follow() -> None:
    """Replicates from the primary by GTID, from the primary's position now (once)."""
    status = mysql_query("SHOW SLAVE STATUS", my_port=MYSQL_REPLICA_PORT)
    if status.stdout.strip():
        return
    if mysql_check() is not None:
        raise ServiceError("mariadb-replica: the primary (mariadb) must run first: scripts/services up mariadb")
    pos = mysql_query("SELECT @@gtid_binlog_pos")
    if pos.returncode != 0:
        raise ServiceError(f"mariadb-replica: reading the primary's position: {pos.stderr.strip()}")
    pw = password("mariadb").replace("'", "''")
    r = mysql_query(f"SET GLOBAL gtid_slave_pos = '{pos.stdout.strip()}'; "
                    f"CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={MYSQL_PORT}, MASTER_USER='{MYSQL_USER}', "
                    f"MASTER_PASSWORD='{pw}', MASTER_USE_GTID=slave_pos, MASTER_CONNECT_RETRY=1; START SLAVE",
                    my_port=MYSQL_REPLICA_PORT)
    if r.returncode != 0:
        raise ServiceError(f"mariadb-replica: starting replication: {r.stderr.strip()}")
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        r = mysql_query("SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS "
                        "WHERE VARIABLE_NAME = 'SLAVE_RUNNING'", my_port=MYSQL_REPLICA_PORT)
        if r.stdout.strip() == "ON":
            return
        time.sleep(0.2)
    raise ServiceError("mariadb-replica: replication did not start; SHOW SLAVE STATUS on it says why")


def mysql_replica_promote() -> None:
    """Applies what the replica received, stops replicating and accepts writes."""
    r = mysql_query("STOP SLAVE IO_THREAD", my_port=MYSQL_REPLICA_PORT)
    if r.returncode != 0:
        raise ServiceError(f"mariadb-replica: STOP SLAVE IO_THREAD: {r.stderr.strip()}")
    status = mysql_query("SHOW SLAVE STATUS", my_port=MYSQL_REPLICA_PORT, headers=True)
    lines = status.stdout.splitlines()
    if status.returncode != 0 or len(lines) < 2:
        raise ServiceError(f"mariadb-replica: it does not replicate: {status.stderr.strip()}")
    received = dict(zip(lines[0].split("\t"), lines[1].split("\t"))).get("Gtid_IO_Pos", "")
    if received:
        r = mysql_query(f"SELECT MASTER_GTID_WAIT('{received}', {START_DEADLINE_S:.0f})", my_port=MYSQL_REPLICA_PORT)
        if r.returncode != 0 or r.stdout.strip() != "0":
            raise ServiceError(f"mariadb-replica: what it received ({received}) was not applied in time: "
                               f"{r.stdout.strip()} {r.stderr.strip()}")
    r = mysql_query("STOP SLAVE; RESET SLAVE ALL; SET GLOBAL read_only = OFF", my_port=MYSQL_REPLICA_PORT)
    if r.returncode != 0:
        raise ServiceError(f"mariadb-replica: promotion failed: {r.stderr.strip()}")


# ---------------------------------------------------------------- ZooKeeper

def zk_prepare() -> None:
    d = STATE / "zookeeper"
    (d / "data").mkdir(parents=True, exist_ok=True)
    tls = tls_copy(d, ["server-bundle.pem", "ca.pem"])
    (d / "zoo.cfg").write_text("\n".join([
        "# outbox-streamer test/demo ZooKeeper (scripts/services)",
        "tickTime=500",
        "minSessionTimeout=1000",
        "maxSessionTimeout=60000",
        f"dataDir={d / 'data'}",
        f"clientPort={ZK_PORT}",
        "clientPortAddress=127.0.0.1",
        "maxClientCnxns=200",
        "admin.enableServer=false",
        "4lw.commands.whitelist=ruok,srvr,stat,mntr",
        "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
        f"secureClientPort={ZK_TLS_PORT}",
        "secureClientPortAddress=127.0.0.1",
        f"ssl.keyStore.location={tls / 'server-bundle.pem'}",
        "ssl.keyStore.type=PEM",
        f"ssl.trustStore.location={tls / 'ca.pem'}",
        "ssl.trustStore.type=PEM",
        "ssl.clientAuth=need",
        "",
    ]))


def zk_command() -> list[str]:
    d = STATE / "zookeeper"
    return ["java", "-Xms64m", "-Xmx256m", f"-Dlogback.configurationFile={HERE / 'zookeeper-logback.xml'}",
            f"-Dzookeeper.outbox.dir={d}", "-cp", classpath("zookeeper"),
            "org.apache.zookeeper.server.ZooKeeperServerMain", str(d / "zoo.cfg")]


def four_letter(p: int, word: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", p), timeout=2) as s:
        s.sendall(word)
        chunks = []
        while True:
            b = s.recv(4096)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks)


def zk_check() -> str | None:
    reply = four_letter(ZK_PORT, b"srvr")
    if b"Mode: standalone" not in reply:
        return f"srvr answered {reply[:80]!r}"
    if port_free(ZK_TLS_PORT):
        return f"the TLS client port {ZK_TLS_PORT} is not listening"
    return None


# ---------------------------------------------------------------- Kafka

def kafka_props() -> Path:
    return STATE / "kafka" / "server.properties"


def kafka_prepare() -> None:
    d = STATE / "kafka"
    (d / "data").mkdir(parents=True, exist_ok=True)
    tls = tls_copy(d, ["server-bundle.pem", "ca.pem"])
    kafka_props().write_text("\n".join([
        "# outbox-streamer test/demo Kafka: one combined broker+controller (KRaft), scripts/services",
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@127.0.0.1:{KAFKA_CONTROLLER_PORT}",
        f"listeners=PLAINTEXT://127.0.0.1:{KAFKA_PORT},CONTROLLER://127.0.0.1:{KAFKA_CONTROLLER_PORT},"
        f"SASL_PLAINTEXT://127.0.0.1:{KAFKA_SASL_PORT},SSL://127.0.0.1:{KAFKA_TLS_PORT}",
        f"advertised.listeners=PLAINTEXT://127.0.0.1:{KAFKA_PORT},SASL_PLAINTEXT://127.0.0.1:{KAFKA_SASL_PORT},"
        f"SSL://127.0.0.1:{KAFKA_TLS_PORT}",
        "controller.listener.names=CONTROLLER",
        "inter.broker.listener.name=PLAINTEXT",
        "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,SSL:SSL",
        "listener.name.ssl.ssl.keystore.type=PEM",
        f"listener.name.ssl.ssl.keystore.location={tls / 'server-bundle.pem'}",
        "listener.name.ssl.ssl.truststore.type=PEM",
        f"listener.name.ssl.ssl.truststore.location={tls / 'ca.pem'}",
        "listener.name.ssl.ssl.client.auth=requested",
        "sasl.enabled.mechanisms=SCRAM-SHA-256,PLAIN",
        "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config="
        "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        "listener.name.sasl_plaintext.plain.sasl.jaas.config="
        f"org.apache.kafka.common.security.plain.PlainLoginModule required "
        f"user_{KAFKA_SASL_USER}=\"{password('kafka-sasl')}\";",
        f"log.dirs={d / 'data'}",
        "num.partitions=1",
        "auto.create.topics.enable=false",
        "offsets.topic.replication.factor=1",
        "offsets.topic.num.partitions=4",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "transaction.state.log.num.partitions=4",
        # The broker aborts a transaction open past its timeout within a second, not ten: the
        # test of a streamer paused past it waits for that.
        "transaction.abort.timed.out.transaction.cleanup.interval.ms=1000",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        "group.initial.rebalance.delay.ms=0",
        "delete.topic.enable=true",
        "",
    ]))
    if (d / "data" / "meta.properties").exists():
        return
    # A cluster id that starts with "-" would be read by the tool as an option (1 time in 64).
    cluster_id = "-"
    while cluster_id.startswith("-"):
        cluster_id = base64.urlsafe_b64encode(secrets.token_bytes(16)).decode().rstrip("=")
    r = run(["java", "-Xmx256m", f"-Dlog4j2.configurationFile={HERE / 'kafka-log4j2.properties'}",
             "-cp", classpath("kafka"), "kafka.tools.StorageTool", "format", "-t", cluster_id,
             "-c", str(kafka_props())])
    if r.returncode != 0:
        raise ServiceError(f"kafka: formatting storage failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")


def kafka_scram_user() -> None:
    """Creates (or updates) the SCRAM-SHA-256 credentials of KAFKA_SASL_USER; idempotent."""
    cmd = ["java", "-Xmx256m", f"-Dlog4j2.configurationFile={HERE / 'kafka-tools-log4j2.properties'}",
           "-cp", classpath("kafka"), "kafka.admin.ConfigCommand", "--bootstrap-server", f"127.0.0.1:{KAFKA_PORT}",
           "--alter", "--entity-type", "users", "--entity-name", KAFKA_SASL_USER,
           "--add-config", f"SCRAM-SHA-256=[iterations=4096,password={password('kafka-sasl')}]"]
    r = run(cmd)
    if r.returncode != 0:
        raise ServiceError(f"kafka: creating the SCRAM user failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


def kafka_command() -> list[str]:
    d = STATE / "kafka"
    return ["java", "-Xms512m", "-Xmx1g", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={HERE / 'kafka-log4j2.properties'}", f"-Dkafka.logs.dir={d}",
            "-cp", classpath("kafka"), "kafka.Kafka", str(kafka_props())]


def kafka_request(sock: socket.socket, api_key: int, version: int, body: bytes, correlation: int) -> bytes:
    client = b"outbox-services"
    header = struct.pack(">hhih", api_key, version, correlation, len(client)) + client
    msg = header + body
    sock.sendall(struct.pack(">i", len(msg)) + msg)
    size = struct.unpack(">i", recv_exact(sock, 4))[0]
    payload = recv_exact(sock, size)
    if struct.unpack(">i", payload[:4])[0] != correlation:
        raise OSError("kafka answered with a different correlation id")
    return payload[4:]


def recv_exact(sock: socket.socket, n: int, peer: str = "kafka") -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise OSError(f"connection closed by {peer}")
        buf += chunk
    return buf


def kafka_check() -> str | None:
    """ApiVersions v0, then Metadata v1: the broker must list itself and a controller."""
    with socket.create_connection(("127.0.0.1", KAFKA_PORT), timeout=2) as s:
        s.settimeout(3)
        versions = kafka_request(s, 18, 0, b"", 1)
        err = struct.unpack(">h", versions[:2])[0]
        if err != 0:
            return f"ApiVersions error code {err}"
        meta = kafka_request(s, 3, 1, struct.pack(">i", 0), 2)  # empty topic list
        (brokers,) = struct.unpack(">i", meta[:4])
        pos = 4
        for _ in range(brokers):
            pos += 4
            (hl,) = struct.unpack(">h", meta[pos:pos + 2])
            pos += 2 + hl + 4
            (rl,) = struct.unpack(">h", meta[pos:pos + 2])
            pos += 2 + max(rl, 0)
        (controller,) = struct.unpack(">i", meta[pos:pos + 4])
        if brokers < 1 or controller < 0:
            return f"metadata lists {brokers} broker(s), controller {controller}"
    if port_free(KAFKA_TLS_PORT):
        return f"the TLS listener on port {KAFKA_TLS_PORT} is not listening"
    return None


# ---------------------------------------------------------------- RabbitMQ

RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
RABBITMQ_USER = "outbox"


def rabbitmq_node() -> str:
    """One Erlang node name per AMQP port: copies of the services on other ports never share one."""
    return f"outbox-{RABBITMQ_PORT}@localhost"


def rabbitmq_prepare() -> None:
    d = STATE / "rabbitmq"
    for p, var in ((RABBITMQ_TLS_PORT, "OUTBOX_RABBITMQ_TLS_PORT"), (RABBITMQ_DIST_PORT, "OUTBOX_RABBITMQ_DIST_PORT")):
        if not port_free(p):
            raise ServiceError(f"rabbitmq: port {p} on 127.0.0.1 is already in use by another process; set {var} "
                               f"to a free port (and use the same value for every scripts/services call)")
    # An epmd of ours left by an earlier start is reused; any other holder of the port is not.
    ours = [p for p in helper_pids(service("rabbitmq")) if comm(p) == "epmd"]
    if not ours and not port_free(RABBITMQ_EPMD_PORT):
        raise ServiceError(f"rabbitmq: port {RABBITMQ_EPMD_PORT} on 127.0.0.1 (its epmd) is already in use by another "
                           f"process; set OUTBOX_RABBITMQ_EPMD_PORT to a free port (and use the same value for every "
                           f"scripts/services call)")
    tls = tls_copy(d, ["server.pem", "server.key", "ca.pem"])
    (d / "log").mkdir(exist_ok=True)
    # No plugins: no management UI, no Prometheus, no other listener.
    (d / "enabled_plugins").write_text("[].\n")
    # Read instead of the system's /etc/rabbitmq/rabbitmq-env.conf; the settings are in rabbitmq_env().
    (d / "rabbitmq-env.conf").write_text("# outbox-streamer: settings come from scripts/services (rabbitmq_env)\n")
    conf = d / "rabbitmq.conf"
    conf.touch(mode=0o600)
    os.chmod(conf, 0o600)  # it holds the password
    conf.write_text("\n".join([
        "# outbox-streamer test/demo RabbitMQ (scripts/services)",
        f"listeners.tcp.1 = 127.0.0.1:{RABBITMQ_PORT}",
        f"listeners.ssl.1 = 127.0.0.1:{RABBITMQ_TLS_PORT}",
        f"ssl_options.cacertfile = {tls / 'ca.pem'}",
        f"ssl_options.certfile = {tls / 'server.pem'}",
        f"ssl_options.keyfile = {tls / 'server.key'}",
        # Client certificates are checked against the private CA when given, not required.
        "ssl_options.verify = verify_peer",
        "ssl_options.fail_if_no_peer_cert = false",
        # Made when the node's database is created (its first start), instead of guest/guest,
        # which then does not exist; with listeners on loopback only, no user needs the
        # loopback restriction.
        f"default_user = {RABBITMQ_USER}",
        f"default_pass = {password('rabbitmq')}",
        "default_user_tags.administrator = true",
        "default_vhost = /",
        "default_permissions.configure = .*",
        "default_permissions.read = .*",
        "default_permissions.write = .*",
        "loopback_users = none",
        "",
    ]))


def rabbitmq_env() -> dict[str, str]:
    d = STATE / "rabbitmq"
    return {
        # Erlang keeps its distribution cookie in $HOME/.erlang.cookie, made at the first start:
        # ours, not /var/lib/rabbitmq's.
        "HOME": str(d),
        "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),
        "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
        "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),  # absent: none
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
        "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
        "RABBITMQ_LOG_BASE": str(d / "log"),
        "RABBITMQ_LOGS": "-",  # to standard output: our log file
        "RABBITMQ_NODENAME": rabbitmq_node(),
        "RABBITMQ_DIST_PORT": str(RABBITMQ_DIST_PORT),
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        # The node starts its own epmd (detached; `stop` ends it, see Service.helpers) on our port.
        "ERL_EPMD_PORT": str(RABBITMQ_EPMD_PORT),
        "ERL_EPMD_ADDRESS": "127.0.0.1",
        # rabbitmq-server then execs the Erlang VM instead of waiting on it in a shell: the pid we
        # record is the VM's, so SIGTERM stops it cleanly and SIGKILL (`crash`) really kills it.
        "detached": "true",
    }


def rabbitmq_command() -> list[str]:
    # The last two words are an Erlang "user flag" nothing reads: they name our directory in
    # the VM's command line, as Service.pid wants.
    return [str(RABBITMQ_BIN / "rabbitmq-server"), "-outbox_services_dir", str(STATE / "rabbitmq")]


def amqp_method(sock: socket.socket) -> tuple[tuple[int, int], bytes]:
    """Reads one frame, which must be a method frame on channel 0: ((class, method), arguments)."""
    frame_type, channel, size = struct.unpack(">BHI", recv_exact(sock, 7, "rabbitmq"))
    payload = recv_exact(sock, size + 1, "rabbitmq")
    if frame_type != 1 or channel != 0 or payload[-1:] != b"\xce":
        raise OSError(f"rabbitmq answered frame type {frame_type} on channel {channel}, expected a method frame (1) on 0")
    return struct.unpack(">HH", payload[:4]), payload[4:-1]


def amqp_send(sock: socket.socket, method: tuple[int, int], args: bytes) -> None:
    payload = struct.pack(">HH", *method) + args
    sock.sendall(struct.pack(">BHI", 1, 0, len(payload)) + payload + b"\xce")


def shortstr(value: str) -> bytes:
    return bytes([len(value.encode())]) + value.encode()


def amqp_login(sock: socket.socket) -> str | None:
    """An AMQP 0-9-1 connection as RABBITMQ_USER to vhost /, closed again: the protocol header
    must be answered with Connection.Start (a method frame), the login with Connection.Tune."""
    sock.sendall(b"AMQP\x00\x00\x09\x01")
    method, _ = amqp_method(sock)
    if method != (10, 10):
        return f"answered the protocol header with method {method}, expected Connection.Start (10, 10)"
    response = f"\0{RABBITMQ_USER}\0{password('rabbitmq')}".encode()
    amqp_send(sock, (10, 11), struct.pack(">I", 0) + shortstr("PLAIN") + struct.pack(">I", len(response))
              + response + shortstr("en_US"))  # Start-Ok: no client properties, PLAIN
    try:
        method, tune = amqp_method(sock)
    except OSError:
        method = None
    if method != (10, 30):
        return (f"login as {RABBITMQ_USER!r} refused (answer {method}); its password is made at the node's first "
                f"start: after {STATE / 'secrets'} was lost, remove {STATE / 'rabbitmq' / 'mnesia'} too")
    channel_max, frame_max, _ = struct.unpack(">HIH", tune[:8])
    amqp_send(sock, (10, 31), struct.pack(">HIH", channel_max, frame_max, 0))  # Tune-Ok: its limits, no heartbeats
    amqp_send(sock, (10, 40), shortstr("/") + shortstr("") + b"\x00")  # Open
    method, _ = amqp_method(sock)
    if method != (10, 41):
        return f"opening vhost / answered method {method}, expected Connection.Open-Ok (10, 41)"
    amqp_send(sock, (10, 50), struct.pack(">H", 200) + shortstr("") + struct.pack(">HH", 0, 0))  # Close
    amqp_method(sock)  # Close-Ok
    return None


def rabbitmq_check() -> str | None:
    with socket.create_connection(("127.0.0.1", RABBITMQ_PORT), timeout=2) as s:
        s.settimeout(3)
        why = amqp_login(s)
        if why:
            return f"port {RABBITMQ_PORT}: {why}"
    context = ssl.create_default_context(cafile=str(tls_dir() / "ca.pem"))
    with socket.create_connection(("127.0.0.1", RABBITMQ_TLS_PORT), timeout=2) as raw:
        raw.settimeout(3)
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            why = amqp_login(s)
            if why:
                return f"TLS port {RABBITMQ_TLS_PORT}: {why}"
    return None


# ---------------------------------------------------------------- registry

SERVICES = [
    Service("postgres", PG_PORT, "OUTBOX_PG_PORT", pg_prepare, pg_command, pg_check,
            run_as="postgres", stop_signal=signal.SIGINT, crash_signal=signal.SIGQUIT),
    Service("mariadb", MYSQL_PORT, "OUTBOX_MYSQL_PORT", mysql_prepare, mysql_command, mysql_check,
            run_as="mysql"),
    Service("kafka", KAFKA_PORT, "OUTBOX_KAFKA_PORT", kafka_prepare, kafka_command, kafka_check,
            after_ready=kafka_scram_user),
    Service("zookeeper", ZK_PORT, "OUTBOX_ZK_PORT", zk_prepare, zk_command, zk_check),
    Service("rabbitmq", RABBITMQ_PORT, "OUTBOX_RABBITMQ_PORT", rabbitmq_prepare, rabbitmq_command, rabbitmq_check,
            run_as="rabbitmq", env=rabbitmq_env, helpers=True),
    Service("postgres-standby", PG_STANDBY_PORT, "OUTBOX_PG_STANDBY_PORT", pg_standby_prepare,
            lambda: pg_command("postgres-standby", PG_STANDBY_PORT, sync_names=""), pg_standby_check,
            run_as="postgres", stop_signal=signal.SIGINT, crash_signal=signal.SIGQUIT, disposable=True),
    Service("mariadb-replica", MYSQL_REPLICA_PORT, "OUTBOX_MYSQL_REPLICA_PORT",
            lambda: mysql_prepare("mariadb-replica"), mysql_replica_command, mysql_replica_check,
            run_as="mysql", after_ready=mysql_replica_follow, disposable=True),
]


def service(name: str) -> Service:
    return next(svc for svc in SERVICES if svc.name == name)


PROMOTE = {"postgres-standby": pg_standby_promote, "mariadb-replica": mysql_replica_promote}


def env_lines() -> list[str]:
    return [
        f"export OUTBOX_PG_URL=postgres://{PG_USER}:{password('postgres')}@127.0.0.1:{PG_PORT}/postgres",
        f"export OUTBOX_MYSQL_URL=mysql://{MYSQL_USER}:{password('mariadb')}@127.0.0.1:{MYSQL_PORT}/mysql",
        f"export OUTBOX_PG_STANDBY_PORT={PG_STANDBY_PORT}",
        f"export OUTBOX_MYSQL_REPLICA_PORT={MYSQL_REPLICA_PORT}",
        f"export OUTBOX_KAFKA_BROKERS=127.0.0.1:{KAFKA_PORT}",
        f"export OUTBOX_KAFKA_SASL_BROKERS=127.0.0.1:{KAFKA_SASL_PORT}",
        f"export OUTBOX_KAFKA_SASL_USER={KAFKA_SASL_USER}",
        f"export OUTBOX_KAFKA_TLS_BROKERS=127.0.0.1:{KAFKA_TLS_PORT}",
        f"export OUTBOX_KAFKA_SASL_PASSWORD={password('kafka-sasl')}",
        f"export OUTBOX_ZK_CONNECT=127.0.0.1:{ZK_PORT}",
        f"export OUTBOX_ZK_TLS_CONNECT=127.0.0.1:{ZK_TLS_PORT}",
        f"export OUTBOX_RABBITMQ_URL=amqp://{RABBITMQ_USER}:{password('rabbitmq')}@127.0.0.1:{RABBITMQ_PORT}/%2f",
        f"export OUTBOX_RABBITMQ_TLS_URL=amqps://{RABBITMQ_USER}:{password('rabbitmq')}@127.0.0.1:{RABBITMQ_TLS_PORT}/%2f",
        f"export OUTBOX_RABBITMQ_PORT={RABBITMQ_PORT}",
        f"export OUTBOX_SERVICES_DIR={STATE}",
        f"export OUTBOX_TLS_DIR={tls_dir()}",
    ]


def pick(names: list[str]) -> list[Service]:
    """The named services (all but the disposable ones when none are named); an unknown name is
    an error."""
    if not names:
        return [svc for svc in SERVICES if not svc.disposable]
    known = {svc.name: svc for svc in SERVICES}
    unknown = [n for n in names if n not in known]
    if unknown:
        fail(f"unknown service {', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in names]


def cmd_up(names: list[str]) -> None:
    global STATE
    began = time.monotonic()
    install()
    STATE = resolve_state()
    STATE.mkdir(parents=True, exist_ok=True)
    try:
        tls_material()
    except ServiceError as e:
        fail(str(e))
    errors: list[str] = []
    deadline = time.monotonic() + START_DEADLINE_S
    lock = threading.Lock()

    def bring_up(svc: Service) -> None:
        try:
            already = svc.pid() is not None
            start(svc)
            wait_ready(svc, deadline)
            with lock:
                say(f"{svc.name:<9} {'already running' if already else 'ready'} on 127.0.0.1:{svc.port} "
                    f"(pid {svc.pid()}, log {svc.log})")
        except ServiceError as e:
            with lock:
                errors.append(str(e))

    threads = [threading.Thread(target=bring_up, args=(s,)) for s in pick(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        fail("\n\n".join(errors) + "\n\n(`scripts/services down` stops what did start)")
    say(f"all services up in {time.monotonic() - began:.1f}s; connection settings: `scripts/services env`")


def cmd_down(names: list[str]) -> None:
    # With no names, the standby and the replica go too (first: they follow a primary).
    chosen = pick(names) if names else SERVICES
    for svc in reversed(chosen):
        pid = svc.pid()
        stop(svc)
        if pid:
            say(f"{svc.name:<9} stopped (pid {pid})")
        elif not svc.disposable:
            say(f"{svc.name:<9} was not running")
        if svc.disposable and svc.dir.exists():
            # A standby or replica is cloned afresh at its next start; a promoted one has a
            # history of its own by now.
            shutil.rmtree(svc.dir)


def cmd_promote(names: list[str]) -> None:
    """Turns a running standby or replica into a primary that accepts writes."""
    for svc in pick(names):
        if svc.name not in PROMOTE:
            fail(f"{svc.name} is not a standby; promote one of {', '.join(PROMOTE)}")
        if svc.pid() is None:
            fail(f"{svc.name} is not running; start it with scripts/services up {svc.name}")
        try:
            PROMOTE[svc.name]()
        except ServiceError as e:
            fail(str(e))
        say(f"{svc.name:<9} promoted: it accepts writes on 127.0.0.1:{svc.port}")


def cmd_crash(names: list[str]) -> None:
    """Ends services as a crash does (see `Service.crash_signal`); `up` starts them again."""
    for svc in pick(names):
        pid = svc.pid()
        if pid is None:
            say(f"{svc.name:<9} was not running")
            continue
        stop(svc, svc.crash_signal)
        say(f"{svc.name:<9} crashed (pid {pid}, signal {signal.Signals(svc.crash_signal).name})")


def cmd_status() -> int:
    print(f"{'service':<10} {'pid':>8} {'port':>6}  state")
    bad = 0
    for svc in SERVICES:
        pid = svc.pid()
        if pid is None and svc.disposable:
            state = "stopped (started only when named)"
        elif pid is None:
            state = "stopped"
            bad += 1
        else:
            try:
                why = svc.check()
            except OSError as e:
                why = str(e)
            state = "answering" if why is None else f"not answering: {why}"
            bad += why is not None
        print(f"{svc.name:<10} {pid or '-':>8} {svc.port:>6}  {state}")
    return 1 if bad else 0


KAFKA_TOOLS = {
    "kafka-topics": "org.apache.kafka.tools.TopicCommand",
    "kafka-console-consumer": "org.apache.kafka.tools.consumer.ConsoleConsumer",
}


def kafka_tool(name: str, args: list[str]) -> int:
    """Runs one of Kafka's own command-line tools against our broker."""
    cmd = ["java", "-Xmx256m", f"-Dlog4j2.configurationFile={HERE / 'kafka-tools-log4j2.properties'}",
           "-cp", classpath("kafka"), KAFKA_TOOLS[name], "--bootstrap-server", f"127.0.0.1:{KAFKA_PORT}", *args]
    return subprocess.run(cmd).returncode


def rabbitmqctl(args: list[str]) -> int:
    """Runs RabbitMQ's own `rabbitmqctl` against our node (its cookie, epmd port and name)."""
    env = {**os.environ, **rabbitmq_env()}
    env.pop("detached", None)
    cmd = [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", rabbitmq_node(), *args]
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str]) -> int:
    usage = ("usage: scripts/services up [SERVICE…] | down [SERVICE…] | crash SERVICE… | promote SERVICE… "
             "| status | env\n"
             "       SERVICE is postgres, mariadb, kafka, zookeeper or rabbitmq (default: these five), or\n"
             "       postgres-standby or mariadb-replica (a standby cloned from its primary when started;\n"
             "       `promote` makes it a primary, `down` throws its data away)\n"
             "       scripts/services kafka-topics ARGS… | kafka-console-consumer ARGS…  (Kafka's own tools, "
             "--bootstrap-server is added)\n"
             "       scripts/services rabbitmqctl ARGS…  (RabbitMQ's own tool, for our node)")
    global STATE
    STATE = resolve_state()
    if argv and argv[0] in KAFKA_TOOLS:
        return kafka_tool(argv[0], argv[1:])
    if argv and argv[0] == "rabbitmqctl":
        return rabbitmqctl(argv[1:])
    if not argv or (len(argv) > 1 and argv[0] not in ("up", "down", "crash", "promote")):
        print(usage, file=sys.stderr)
        return 2
    cmd = argv[0]
    if cmd == "up":
        cmd_up(argv[1:])
    elif cmd == "down":
        cmd_down(argv[1:])
    elif cmd == "crash" and len(argv) > 1:
        cmd_crash(argv[1:])
    elif cmd == "promote" and len(argv) > 1:
        cmd_promote(argv[1:])
    elif cmd == "status":
        return cmd_status()
    elif cmd == "env":
        print("\n".join(env_lines()))
    else:
        print(usage, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
