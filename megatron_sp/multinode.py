"""The multi-node side of the launcher: hostfile, slot selection, the ranks' environment, remote command
strings (every piece ``shlex.quote``d; host names only ``[A-Za-z0-9._-]``, never starting with '-').
See docs/launcher.md.
"""
from __future__ import annotations

import re
import shlex
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .errors import LaunchError, read_utf8

AUTO_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "WANDB_")
AUTO_ENV_NAMES = ("PYTHONPATH",)
MAX_SLOTS = 1024  # processes on one host: far above any node's devices (a typo like slots=1e20 is refused)

_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Host:
    """One host of the launch and the slot (device) indices it uses."""

    name: str
    slots: tuple[int, ...]

    @property
    def nproc(self) -> int:
        return len(self.slots)

    @property
    def visible_devices(self) -> str | None:
        """CUDA_VISIBLE_DEVICES for a slot selection other than the first n slots, else None."""
        return None if self.slots == tuple(range(len(self.slots))) else ",".join(map(str, self.slots))


def check_hostname(name: str, where: str) -> str:
    """``name`` lower-cased without a trailing '.' if it is a plain host name or IPv4 address, else a LaunchError."""
    if not _HOST_RE.fullmatch(name) or name.startswith("-"):
        raise LaunchError(f"{where}: host name {name!r} is not allowed: use only letters, digits, '.', '_' and '-' "
                          "and do not start with '-' (for user@host, ports or IPv6 use an alias in ~/.ssh/config)")
    normal = name.rstrip(".").lower()
    if not normal:
        raise LaunchError(f"{where}: host name {name!r} is not allowed: it has no letters or digits")
    return normal


def parse_hostfile(path: str | Path) -> dict[str, int]:
    """``{host: slots}`` in file order from lines ``host slots=N`` (blank lines and ``#`` comments skipped)."""
    p = Path(path)
    if not p.is_file():
        raise LaunchError(f"--hostfile {p}: file not found; write one 'host slots=N' line per host")
    hosts: dict[str, int] = {}
    lines = read_utf8(p, "--hostfile", "is this the right file?", LaunchError).splitlines()
    for lineno, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{p}:{lineno}"
        parts = line.split()
        m = re.fullmatch(r"slots=(\S+)", parts[1]) if len(parts) == 2 else None
        if m is None:
            raise LaunchError(f"{where}: expected 'host slots=N', got {line!r}")
        name = check_hostname(parts[0], where)
        try:
            slots = int(m.group(1))
        except ValueError:
            raise LaunchError(f"{where}: slots={m.group(1)!r} is not an integer; write e.g. '{name} slots=8'") from None
        if slots < 1:
            raise LaunchError(f"{where}: slots={slots} for {name}; a host needs at least 1 slot (or delete the line)")
        if slots > MAX_SLOTS:
            raise LaunchError(f"{where}: slots={slots} for {name} is more than {MAX_SLOTS} processes on one host; "
                              "write the number of devices (GPUs) of that host")
        if name in hosts:
            raise LaunchError(f"{where}: host {name} is listed twice (host names are case-insensitive and a "
                              "trailing '.' does not count); keep one line per host")
        hosts[name] = slots
    if not hosts:
        raise LaunchError(f"--hostfile {p}: no hosts; write one 'host slots=N' line per host")
    return hosts


def parse_host_spec(spec: str, flag: str, pool: Mapping[str, int], hostfile: str) -> dict[str, tuple[int, ...] | None]:
    """``--include``/``--exclude`` value ``a@b:0,2`` → ``{host: slots or None (the whole host)}``."""
    out: dict[str, tuple[int, ...] | None] = {}
    for part in spec.split("@"):
        name, sep, slot_text = part.partition(":")
        if not name:
            raise LaunchError(f"{flag} {spec!r}: empty host entry; write host1@host2:0,1")
        name = check_hostname(name, flag)
        if name not in pool:
            raise LaunchError(f"{flag}: host {name} is not in --hostfile {hostfile} (hosts: {', '.join(pool)})")
        if name in out:
            raise LaunchError(f"{flag}: host {name} appears twice in {spec!r}")
        if not sep:
            out[name] = None
            continue
        try:
            slots = tuple(int(s) for s in slot_text.split(","))
        except ValueError:
            raise LaunchError(f"{flag}: slots {slot_text!r} of {name} must be comma-separated integers, "
                              f"e.g. {name}:0,1") from None
        bad = [s for s in slots if not 0 <= s < pool[name]]
        if bad:
            raise LaunchError(f"{flag}: slot {bad[0]} of {name} is out of range; {hostfile} gives it "
                              f"slots=0..{pool[name] - 1}")
        if len(set(slots)) != len(slots):
            raise LaunchError(f"{flag}: {name} lists a slot twice in {slot_text!r}")
        out[name] = tuple(sorted(slots))
    return out


def select_hosts(pool: Mapping[str, int], hostfile: str, include: str | None = None, exclude: str | None = None,
                 num_nodes: int | None = None, nproc_per_node: int | None = None) -> list[Host]:
    """The hosts and slots of the launch, in hostfile order."""
    if include and exclude:
        raise LaunchError("--include and --exclude cannot be combined; use one of them")
    spec = parse_host_spec(include or exclude, "--include" if include else "--exclude", pool, hostfile) \
        if include or exclude else {}
    hosts = []
    for h, n in pool.items():
        listed = (spec[h] or tuple(range(n))) if h in spec else ()  # None: the whole host
        slots = listed if include else tuple(s for s in range(n) if s not in listed)
        if slots:
            hosts.append(Host(h, slots))
    if not hosts:
        raise LaunchError(f"--exclude {exclude!r} leaves no host of {hostfile}")
    if num_nodes is not None:  # (>= 1: checked with the other launcher options)
        if num_nodes > len(hosts):
            raise LaunchError(f"--num-nodes {num_nodes}: only {len(hosts)} host(s) available from {hostfile} "
                              "(after --include/--exclude)")
        hosts = hosts[:num_nodes]
    if nproc_per_node is not None:
        for h in hosts:
            if nproc_per_node > h.nproc:
                raise LaunchError(f"--nproc-per-node {nproc_per_node}: host {h.name} has only {h.nproc} slot(s) "
                                  f"(in {hostfile}, after --include/--exclude)")
        hosts = [Host(h.name, h.slots[:nproc_per_node]) for h in hosts]
    return hosts

# ----------------------------------------------------------------------------- environment

@dataclass
class EnvSpec:
    """Variables for every rank: ``auto`` (from this shell; remote launchers) and ``explicit`` (.deepy_env, --env)."""

    auto: dict[str, str] = field(default_factory=dict)
    explicit: dict[str, str] = field(default_factory=dict)

    def remote(self) -> dict[str, str]:
        return {**self.auto, **self.explicit}


def _check_env_name(name: str, where: str) -> str:
    if not _ENV_NAME_RE.fullmatch(name):
        raise LaunchError(f"{where}: {name!r} is not a valid environment variable name (letters, digits, '_'; "
                          "not starting with a digit)")
    return name


def collect_env(user: list[str], environ: Mapping[str, str], env_file: Path | None) -> EnvSpec:
    """Automatic variables from ``environ``, then ``env_file`` lines ``KEY=VALUE``, then ``--env`` items."""
    spec = EnvSpec(auto={k: environ[k] for k in sorted(environ)
                         if k in AUTO_ENV_NAMES or k.startswith(AUTO_ENV_PREFIXES)})
    if env_file is not None and env_file.is_file():
        lines = read_utf8(env_file, "environment file", "is this the right file?", LaunchError).splitlines()
        for lineno, raw in enumerate(lines, start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                raise LaunchError(f"{env_file}:{lineno}: expected KEY=VALUE, got {line!r}")
            spec.explicit[_check_env_name(key.strip(), f"{env_file}:{lineno}")] = value.strip()
    for item in user:
        key, sep, value = item.partition("=")
        _check_env_name(key, f"--env {item}")
        if not sep:
            if key not in environ:
                raise LaunchError(f"--env {key}: {key} is not set in this shell; give a value with --env {key}=VALUE")
            value = environ[key]
        spec.explicit[key] = value
    return spec


# ----------------------------------------------------------------------------- remote commands

def env_prefix(env: Mapping[str, str]) -> list[str]:
    """``env K=V ...`` before a command (nothing for no variables)."""
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def remote_command(cwd: str, env: Mapping[str, str], argv: list[str]) -> str:
    """The shell string a remote login shell runs: ``cd CWD && exec env K=V ... argv``, every piece quoted."""
    return f"cd {shlex.quote(cwd)} && exec {shlex.join([*env_prefix(env), *argv])}"


def uniform_slots(hosts: list[Host], launcher: str) -> tuple[int, str | None]:
    """pdsh and srun run one command on every host: the slots must agree."""
    counts = {h.nproc for h in hosts}
    devices = {h.visible_devices for h in hosts}
    if len(counts) > 1 or len(devices) > 1:
        detail = ", ".join(f"{h.name}:{','.join(map(str, h.slots))}" for h in hosts)
        raise LaunchError(f"--launcher {launcher} runs the same command on every host, but the selected slots differ "
                          f"({detail}); give every host the same slots or use --launcher ssh")
    return hosts[0].nproc, hosts[0].visible_devices


def slurm_hosts(environ: Mapping[str, str]) -> list[str]:
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchError("--launcher slurm without --hostfile needs a Slurm allocation (SLURM_JOB_NODELIST is not "
                          "set); run inside salloc/sbatch, or give --hostfile or --master-addr and --num-nodes")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise LaunchError(f"could not expand SLURM_JOB_NODELIST={nodelist!r} with 'scontrol show hostnames' ({exc}); "
                          "give --master-addr") from None
    return [check_hostname(h, "SLURM_JOB_NODELIST") for h in out.stdout.split()]


def hosts_text(hosts: list[Host]) -> str:
    return ", ".join(f"{h.name}×{h.nproc}" for h in hosts)


def with_devices(env: Mapping[str, str], devices: str | None) -> dict[str, str]:
    """``env`` plus the CUDA_VISIBLE_DEVICES of a slot selection, if any (given twice, differently: an error)."""
    if devices is None:
        return dict(env)
    if "CUDA_VISIBLE_DEVICES" in env and env["CUDA_VISIBLE_DEVICES"] != devices:
        raise LaunchError("CUDA_VISIBLE_DEVICES is given with --env/.deepy_env and by a slot selection "
                          "(--include/--exclude/--nproc-per-node); keep one of them")
    return {**env, "CUDA_VISIBLE_DEVICES": devices}


# ----------------------------------------------------------------------------- the rendezvous port

def is_this_host(name: str) -> bool:
    """Whether host ``name`` is this machine, by torchrun's rule for who serves the c10d store: localhost, a loopback
    address, this host name, or a name resolving to one of its addresses."""
    if name == "localhost" or name.startswith("127."):
        return True
    this = socket.gethostname().lower()
    if name in (this, this.split(".")[0]):
        return True
    try:
        theirs = {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
        return bool(theirs & {info[4][0] for info in socket.getaddrinfo(this, None, proto=socket.IPPROTO_TCP)})
    except (OSError, UnicodeError):
        return False


def check_port_free(port: int, host: str) -> None:
    """A ``LaunchError`` naming ``port`` when the rendezvous served on this host (``host``) cannot bind it: torchrun
    would join whatever listens there (another job's store: a traceback later; anything else: a silent hang)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port left in TIME_WAIT is free
        try:
            s.bind(("", port))
        except OSError as exc:
            raise LaunchError(f"the rendezvous port {port} is in use on {host} (this host, which serves the rendezvous: "
                              f"{exc.strerror}; another job's?); choose a free --master-port") from None
