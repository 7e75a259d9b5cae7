"""Multi-node launcher behind ``deepy.py``: one ``torchrun`` per host, started over ssh, pdsh or srun.

``python deepy.py [launcher options] train.py --conf a.yml [--hostfile hosts] [script args] [-- script args]``

Pipeline: ``split_argv`` (launcher vs script options) → ``parse_hostfile`` / ``select_hosts`` →
``collect_env`` (``NCCL_*`` etc., ``.deepy_env``, ``--env``) → ``build_plan`` (exact argv lists;
``--dry-run`` prints them) → ``execute`` (first failing host stops the others). Nothing runs
through a local shell; remote command pieces are ``shlex.quote``d and hostnames are restricted to
``[A-Za-z0-9._-]``. Rendezvous is torchrun's ``c10d`` unless ``--rdzv-backend static``.

Details (argument splitting rules, environment order, safety, rendezvous): docs/launcher.md.
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from .errors import UserError, read_utf8

LAUNCHERS = ("ssh", "pdsh", "slurm", "local")
DEFAULT_MASTER_PORT = 29500
ENV_FILE = ".deepy_env"
AUTO_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "WANDB_")
AUTO_ENV_NAMES = ("PYTHONPATH",)
STOP_GRACE_S = 30.0  # after SIGTERM, how long a launched process may take to stop before SIGKILL
MAX_SLOTS = 1024  # processes on one host: far above any node's devices (a typo like slots=1e20 is refused)

_HOST_RE = re.compile(r"[A-Za-z0-9._-]+")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OVERRIDE_RE = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*=")


class LaunchError(UserError):
    """A launcher option, hostfile, environment or layout problem: one line, exit code 2."""

    exit_code = 2


# ----------------------------------------------------------------------------- command line

def _build_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """The launcher's options, and the set of those that take a value."""
    parser = _Parser(
        prog="deepy.py", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="python deepy.py [options] SCRIPT [script args] [-- script args]",
        description="Launch SCRIPT (e.g. train.py) with one torchrun per host. Launcher options may come "
                    "before SCRIPT or (long form only) among its arguments; after '--' every argument is "
                    "the script's.")
    add = parser.add_argument
    add("--hostfile", metavar="PATH", help="lines 'host slots=N' (# comments); without it: launch on this machine")
    add("--include", metavar="SPEC", help="only these hosts/slots, DeepSpeed syntax: 'a@b' or 'a:0,1@b'")
    add("--exclude", metavar="SPEC", help="all hosts but these hosts/slots, same syntax as --include")
    add("--num-nodes", "--num_nodes", type=int, metavar="N", help="use the first N hosts (after include/exclude)")
    add("--nproc-per-node", "--num-gpus", "--num_gpus", "--nproc_per_node", type=int, metavar="N",
        help="processes per host (the first N of its slots); default: the hostfile's slots, or the config's "
             "world size on this machine")
    add("--master-addr", "--master_addr", metavar="HOST", help="rendezvous host (default: the first host)")
    add("--master-port", "--master_port", type=int, metavar="PORT",
        help=f"rendezvous port (default {DEFAULT_MASTER_PORT}; local: a free port unless given)")
    add("--launcher", choices=LAUNCHERS, help="ssh (default with a hostfile) | pdsh | slurm | local (default without)")
    add("--rdzv-backend", choices=("c10d", "static"), default="c10d",
        help="c10d (default): torchrun assigns node ranks; static (ssh only): node rank = hostfile order")
    add("--rdzv-id", metavar="ID", help="rendezvous id (default: $SLURM_JOB_ID under slurm, else random)")
    add("--env", action="append", default=[], metavar="KEY[=VALUE]",
        help="also export KEY (its value here) or KEY=VALUE to every rank; repeatable")
    add("--python", default=sys.executable, metavar="EXE", help="python on the hosts (default: this one, %(default)s)")
    add("--module", action="store_true", help="SCRIPT is a module name (torchrun --module)")
    add("--max-restarts", "--max_restarts", type=int, metavar="N", help="passed to torchrun (restarts of the worker group)")
    add("--ssh-port", type=int, metavar="PORT", help="ssh port (ssh launcher)")
    add("--dry-run", action="store_true", help="print the exact commands and exit without running anything")
    valued = {opt for action in parser._actions if action.nargs != 0 for opt in action.option_strings}
    return parser, valued


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage block
        raise LaunchError(f"{message}; see python deepy.py --help")


def split_argv(argv: list[str], valued: set[str], known: set[str]) -> tuple[list[str], list[str]]:
    """Split deepy.py's arguments into (launcher options, [script, *script args]).

    Before the script every ``-x``/``--x`` token is a launcher option; after it only the launcher's
    exact long options (``--hostfile hosts`` or ``--hostfile=hosts``) are; ``--`` hands every later
    token to the script (the first one is the script itself if none was given yet).
    """
    own: list[str] = []
    command: list[str] = []
    verbatim = False
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if verbatim:
            command.append(tok)
            continue
        if tok == "--":
            verbatim = True
            continue
        name = tok.split("=", 1)[0]
        ours = tok.startswith("-") if not command else (name.startswith("--") and name in known and name != "--help")
        if not ours:
            command.append(tok)
            continue
        own.append(tok)
        if name in valued and "=" not in tok and i < len(argv):
            own.append(argv[i])
            i += 1
    return own, command


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options and the script command (script and its arguments)."""
    parser, valued = _build_parser()
    known = {opt for action in parser._actions for opt in action.option_strings}
    own, command = split_argv(argv, valued, known)
    i = 0
    while i < len(own):
        name = own[i].split("=", 1)[0]
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else "; see python deepy.py --help"
            raise LaunchError(f"unknown option {name}{hint} (an option of the script goes after the script or "
                              "after '--')")
        i += 2 if name in valued and "=" not in own[i] else 1  # skip the option's value
    args = parser.parse_args(own)
    if not command:
        raise LaunchError("no script to launch; usage: python deepy.py [options] train.py --conf CONFIG [args]")
    if command[0].startswith("-"):
        raise LaunchError(f"script '{command[0]}' starts with '-' and would read as a torchrun option; "
                          f"write ./{command[0]}")
    return args, command


# ----------------------------------------------------------------------------- hosts

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
    """``name`` normalised (lower case, no trailing '.': DNS names are case-insensitive and ``node1.`` is
    ``node1``) if it is a plain host name or IPv4 address; a LaunchError naming ``where`` otherwise."""
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
    if include:
        chosen = parse_host_spec(include, "--include", pool, hostfile)
        hosts = [Host(h, chosen[h] or tuple(range(pool[h]))) for h in pool if h in chosen]
    else:
        dropped = parse_host_spec(exclude, "--exclude", pool, hostfile) if exclude else {}
        hosts = []
        for h, n in pool.items():
            if h in dropped and dropped[h] is None:
                continue
            slots = tuple(s for s in range(n) if s not in (dropped.get(h) or ()))
            if slots:
                hosts.append(Host(h, slots))
    if not hosts:
        raise LaunchError(f"--exclude {exclude!r} leaves no host of {hostfile}")
    if num_nodes is not None:
        if num_nodes < 1:
            raise LaunchError(f"--num-nodes {num_nodes}: must be at least 1")
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
    """Variables for every rank: ``auto`` (copied from this shell; remote launchers only) and
    ``explicit`` (``.deepy_env`` and ``--env``; every launcher)."""

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


# ----------------------------------------------------------------------------- config

@dataclass(frozen=True)
class Layout:
    """The ranks a train.py config asks for: ``world`` (None when parallel.dp is derived) and tp·pp·cp."""

    source: str
    world: int | None
    model_parallel: int
    factors: str


def config_layout(script_args: list[str]) -> Layout | None:
    """The layout of train.py's ``--conf`` files and dotted overrides among ``script_args`` (None without --conf).

    Uses the config loader without ``finalize`` (no torch import): only the parallel degrees are read.
    """
    confs: list[str] = []
    overrides: list[str] = []
    it = iter(script_args)
    for tok in it:
        if tok == "--conf":
            value = next(it, None)
            if value is not None:
                confs.append(value)
        elif tok.startswith("--conf="):
            confs.append(tok.split("=", 1)[1])
        elif _OVERRIDE_RE.match(tok):
            overrides.append(tok)
    if not confs:
        return None
    from .config import load

    p = load(confs, overrides, finalize_config=False).parallel
    mp = p.tp * p.pp * p.cp
    if mp < 1 or (p.dp is not None and p.dp < 1):
        return None  # train.py reports the bad degree itself
    world = p.world_size or (mp * p.dp if p.dp is not None else None)
    factors = f"tp·pp·cp·dp = {p.tp}·{p.pp}·{p.cp}·{p.dp if p.dp is not None else '?'}"
    return Layout(" ".join(confs), world, mp, factors)


def check_layout(layout: Layout | None, total: int, launched: str) -> None:
    """Fail before launching when ``total`` ranks (described by ``launched``) cannot run the config."""
    if layout is None:
        return
    fix = "change the hostfile, --include/--exclude, --num-nodes or --nproc-per-node"
    if layout.world is not None and layout.world != total:
        dp = f"parallel.dp={total // layout.model_parallel}" if total % layout.model_parallel == 0 else "parallel.dp"
        raise LaunchError(f"the launch gives {total} ranks ({launched}) but {layout.source} asks for {layout.factors} "
                          f"= {layout.world}; set {dp} (or parallel.dp=null to derive it), or {fix}")
    if layout.world is None and total % layout.model_parallel:
        raise LaunchError(f"the launch gives {total} ranks ({launched}), not a multiple of tp·pp·cp = "
                          f"{layout.model_parallel} ({layout.source}); {fix}")


# ----------------------------------------------------------------------------- plan

@dataclass
class Command:
    """One process deepy starts: ``label`` (host name, or the launcher) and its exact argv."""

    label: str
    argv: list[str]


@dataclass
class LaunchPlan:
    """What ``deepy`` runs: the ``launcher`` used, its ``commands`` and a one-line ``summary``.
    (Not ``plan.LayoutPlan``, the memory/communication plan of a config.)"""

    launcher: str
    commands: list[Command]
    summary: str


def _env_prefix(env: Mapping[str, str]) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in env.items())] if env else []


def remote_command(cwd: str, env: Mapping[str, str], argv: list[str]) -> str:
    """The shell string a remote login shell runs: ``cd CWD && exec env K=V ... argv``, every piece quoted."""
    return f"cd {shlex.quote(cwd)} && exec {shlex.join([*_env_prefix(env), *argv])}"


def pdsh_escape(command: str) -> str:
    """Double every ``%``: pdsh substitutes ``%h``, ``%u``, ``%n`` in the command it runs and turns ``%%`` into ``%``."""
    return command.replace("%", "%%")


def _uniform(hosts: list[Host], launcher: str) -> tuple[int, str | None]:
    """pdsh and srun run one command on every host: the slots must agree."""
    counts = {h.nproc for h in hosts}
    devices = {h.visible_devices for h in hosts}
    if len(counts) > 1 or len(devices) > 1:
        detail = ", ".join(f"{h.name}:{','.join(map(str, h.slots))}" for h in hosts)
        raise LaunchError(f"--launcher {launcher} runs the same command on every host, but the selected slots differ "
                          f"({detail}); give every host the same slots or use --launcher ssh")
    return hosts[0].nproc, hosts[0].visible_devices


def _slurm_hosts(environ: Mapping[str, str]) -> list[str]:
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


def _hosts_text(hosts: list[Host]) -> str:
    return ", ".join(f"{h.name}×{h.nproc}" for h in hosts)


@dataclass
class _Request:
    """What every launcher's plan is built from (after validation)."""

    args: argparse.Namespace
    command: list[str]  # script (or module) and its arguments
    hosts: list[Host]  # empty without --hostfile
    env: EnvSpec
    layout: Layout | None
    port: int
    rdzv_id: str
    cwd: str

    @property
    def name(self) -> str:
        return self.command[0]

    def torchrun(self, nnodes: int, nproc: int, rendezvous: list[str]) -> list[str]:
        argv = [self.args.python, "-u", "-m", "torch.distributed.run", "--nnodes", str(nnodes),
                "--nproc-per-node", str(nproc), *rendezvous]
        if self.args.max_restarts is not None:
            argv += ["--max-restarts", str(self.args.max_restarts)]
        if self.args.module:
            argv.append("--module")
        return argv + self.command

    def c10d(self, addr: str) -> list[str]:
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{self.port}", "--rdzv-id", self.rdzv_id]


def build_plan(args: argparse.Namespace, command: list[str], environ: Mapping[str, str], cwd: str) -> LaunchPlan:
    """The exact commands of the launch (nothing is run here, except ``scontrol`` under slurm)."""
    if not args.module and not Path(cwd, command[0]).is_file():
        raise LaunchError(f"script {command[0]!r} not found in {cwd}; give a path relative to the current directory "
                          "(or --module for a module name)")
    for flag, port in (("--master-port", args.master_port), ("--ssh-port", args.ssh_port)):
        if port is not None and not 1 <= port <= 65535:
            raise LaunchError(f"{flag} {port}: must be in 1..65535")
    if args.max_restarts is not None and args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts}: must be >= 0")
    for flag, count in (("--nproc-per-node", args.nproc_per_node), ("--num-nodes", args.num_nodes)):
        if count is not None and count < 1:
            raise LaunchError(f"{flag} {count}: must be at least 1")
    if args.nproc_per_node is not None and args.nproc_per_node > MAX_SLOTS:
        raise LaunchError(f"--nproc-per-node {args.nproc_per_node}: more than {MAX_SLOTS} processes on one host; "
                          "give the number of devices per host")
    if args.max_restarts is not None and args.max_restarts > 1000:
        raise LaunchError(f"--max-restarts {args.max_restarts}: at most 1000")
    if args.master_addr is not None:
        args.master_addr = check_hostname(args.master_addr, "--master-addr")
    launcher = args.launcher or ("ssh" if args.hostfile else "local")
    if args.rdzv_backend == "static" and launcher != "ssh":
        raise LaunchError(f"--rdzv-backend static needs a per-host node rank, which only --launcher ssh passes; "
                          f"use the default c10d with --launcher {launcher}")
    if (args.include or args.exclude) and not args.hostfile:
        raise LaunchError("--include/--exclude select hosts and slots of a --hostfile; without one, deepy launches "
                          "on this machine (use --nproc-per-node and CUDA_VISIBLE_DEVICES there)")
    if launcher in ("ssh", "pdsh") and not args.hostfile:
        raise LaunchError(f"--launcher {launcher} needs --hostfile (lines 'host slots=N')")
    hosts: list[Host] = []
    if args.hostfile:
        pool = parse_hostfile(args.hostfile)
        hosts = select_hosts(pool, args.hostfile, args.include, args.exclude, args.num_nodes, args.nproc_per_node)
    rdzv_id = args.rdzv_id or (environ.get("SLURM_JOB_ID") if launcher == "slurm" else None) or uuid.uuid4().hex[:12]
    req = _Request(args, command, hosts, collect_env(args.env, environ, Path(cwd, ENV_FILE)),
                   config_layout(command[1:]), args.master_port or DEFAULT_MASTER_PORT, rdzv_id, cwd)
    if launcher == "local":
        return _plan_local(req)
    if launcher == "slurm":
        return _plan_slurm(req, environ)
    return _plan_remote(req, launcher)


def _plan_local(req: _Request) -> LaunchPlan:
    """torchrun on this machine: ``--standalone`` (a free port) unless --master-port is given."""
    args, hosts = req.args, req.hosts
    if len(hosts) > 1 or (args.num_nodes or 1) > 1:
        raise LaunchError(f"--launcher local starts ranks on this machine only, but {len(hosts) or args.num_nodes} "
                          "hosts are selected; use --launcher ssh/pdsh/slurm or select one host")
    env = dict(req.env.explicit)  # the rest of this shell's environment is inherited
    if hosts:
        nproc = hosts[0].nproc
        if hosts[0].visible_devices:
            env = _with_devices(env, hosts[0].visible_devices)
    elif args.nproc_per_node:
        nproc = args.nproc_per_node
    elif req.layout is not None:
        nproc = req.layout.world or req.layout.model_parallel  # dp derived: 1, as train.py does on its own
    else:
        raise LaunchError(f"--nproc-per-node is needed: {req.name} has no --conf to take the number of ranks from")
    check_layout(req.layout, nproc, "on this machine")
    if args.master_port is None:
        rendezvous, where = ["--standalone"], "a free local port"
    else:
        addr = args.master_addr or "127.0.0.1"
        rendezvous, where = req.c10d(addr), f"{addr}:{req.port}"
    argv = [*_env_prefix(env), *req.torchrun(1, nproc, rendezvous)]
    return LaunchPlan("local", [Command("local", argv)], f"local launch of {req.name}: {nproc} ranks on this machine, "
                                                   f"rendezvous on {where}")


def _plan_slurm(req: _Request, environ: Mapping[str, str]) -> LaunchPlan:
    """One srun step, one torchrun per node; this shell's environment goes along (--export=ALL)."""
    args, hosts = req.args, req.hosts
    env = dict(req.env.explicit)
    if hosts:
        nproc, devices = _uniform(hosts, "slurm")
        if devices:
            env = _with_devices(env, devices)
        names = [h.name for h in hosts]
        nodes = len(hosts)
    else:
        nodes_text = str(args.num_nodes or "") or environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
        if not nodes_text or not nodes_text.isdigit() or int(nodes_text) < 1:
            raise LaunchError("--launcher slurm without --hostfile needs --num-nodes (or a Slurm allocation: "
                              f"SLURM_JOB_NUM_NODES is {nodes_text or 'not set'})")
        nodes = int(nodes_text)
        names = [] if args.master_addr else _slurm_hosts(environ)
        if names and len(names) < nodes:
            raise LaunchError(f"--num-nodes {nodes}: the Slurm allocation has only {len(names)} node(s)")
        names = names[:nodes]
        if args.nproc_per_node:
            nproc = args.nproc_per_node
        elif req.layout is not None and req.layout.world is not None and req.layout.world % nodes == 0:
            nproc = req.layout.world // nodes
        else:
            raise LaunchError(f"--nproc-per-node is needed: the ranks per node of {req.name} on {nodes} Slurm node(s) "
                              "cannot be taken from the hostfile or the config")
    check_layout(req.layout, nodes * nproc, f"{nodes} node(s) × {nproc}")
    master = args.master_addr or names[0]
    srun = ["srun", "--nodes", str(nodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1", "--export=ALL"]
    if names:
        srun += ["--nodelist", ",".join(names)]
    argv = [*_env_prefix(env), *srun, *req.torchrun(nodes, nproc, req.c10d(master))]
    return LaunchPlan("slurm", [Command("slurm", argv)], f"slurm launch of {req.name}: {nodes} node(s) × {nproc} ranks, "
                                                   f"rendezvous c10d at {master}:{req.port} (id {req.rdzv_id})")


def _plan_remote(req: _Request, launcher: str) -> LaunchPlan:
    """ssh (one command per host) or pdsh (one for all): a remote login shell runs a quoted command string."""
    args, hosts = req.args, req.hosts
    total = sum(h.nproc for h in hosts)
    check_layout(req.layout, total, _hosts_text(hosts))
    master = args.master_addr or hosts[0].name
    env = req.env.remote()
    summary = f"{launcher} launch of {req.name}: {len(hosts)} host(s) ({_hosts_text(hosts)}), {total} ranks, "
    if launcher == "pdsh":
        nproc, devices = _uniform(hosts, "pdsh")
        remote = remote_command(req.cwd, _with_devices(env, devices) if devices else env,
                                req.torchrun(len(hosts), nproc, req.c10d(master)))
        argv = ["pdsh", "-R", "ssh", "-S", "-f", "1024", "-w", ",".join(h.name for h in hosts), pdsh_escape(remote)]
        return LaunchPlan("pdsh", [Command("pdsh", argv)],
                    summary + f"rendezvous c10d at {master}:{req.port} (id {req.rdzv_id})")
    # -tt: closing the connection (deepy stopping) hangs up the remote torchrun, which then stops its workers
    ssh = ["ssh", "-tt", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
    if args.ssh_port is not None:
        ssh += ["-p", str(args.ssh_port)]
    commands = []
    for rank, h in enumerate(hosts):
        if args.rdzv_backend == "static":
            rendezvous = ["--node-rank", str(rank), "--master-addr", master, "--master-port", str(req.port)]
        else:
            rendezvous = req.c10d(master)
        remote = remote_command(req.cwd, _with_devices(env, h.visible_devices) if h.visible_devices else env,
                                req.torchrun(len(hosts), h.nproc, rendezvous))
        commands.append(Command(h.name, [*ssh, "--", h.name, remote]))
    how = f"static rendezvous at {master}:{req.port}" if args.rdzv_backend == "static" else \
        f"rendezvous c10d at {master}:{req.port} (id {req.rdzv_id})"
    return LaunchPlan("ssh", commands, summary + how)


def _with_devices(env: Mapping[str, str], devices: str) -> dict[str, str]:
    if "CUDA_VISIBLE_DEVICES" in env and env["CUDA_VISIBLE_DEVICES"] != devices:
        raise LaunchError("CUDA_VISIBLE_DEVICES is given with --env/.deepy_env and by a slot selection "
                          "(--include/--exclude/--nproc-per-node); keep one of them")
    return {**env, "CUDA_VISIBLE_DEVICES": devices}


# ----------------------------------------------------------------------------- execution

class _Stop(Exception):
    """SIGTERM (or SIGHUP) reached deepy: stop what it started."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def _stop_all(procs: list[subprocess.Popen], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to each still-running process group (each child leads its own session), SIGKILL after
    ``grace`` seconds, or at once on a second Ctrl-C."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        pass
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # the child's own session: its process group id is its pid
    except ProcessLookupError:
        pass


def _pump(label: str, stream: Any, out: TextIO, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, prefixed ``label: `` (the \\r of ssh -tt's terminal dropped)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n").replace("\r", "")
        with lock:
            out.write(f"{label}: {line}\n")
            out.flush()
    stream.close()


def execute(plan: LaunchPlan, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the plan's commands; return the exit code (the first failing command's, 130 on interrupt).

    Each command starts in its own session so deepy decides how it stops: on Ctrl-C, SIGTERM or a
    failing host, every other command's process group gets SIGTERM (torchrun stops its workers;
    ``ssh -tt`` closes the connection and the remote torchrun gets SIGHUP), then SIGKILL after
    ``STOP_GRACE_S``.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    prefix = plan.launcher == "ssh"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)} if in_main else {}
    try:
        for cmd in plan.commands:
            pipe = subprocess.PIPE if prefix else None  # ssh output gets a host prefix; the others keep the terminal
            try:
                p = subprocess.Popen(cmd.argv, stdin=subprocess.DEVNULL, stdout=pipe,
                                     stderr=subprocess.STDOUT if prefix else None, start_new_session=True)
            except OSError as exc:
                _stop_all(procs)
                raise LaunchError(f"cannot start {cmd.argv[0]!r} ({exc.strerror}); install it or choose another "
                                  "--launcher") from None
            procs.append(p)
            if prefix:
                t = threading.Thread(target=_pump, args=(cmd.label, p.stdout, out, lock), daemon=True)
                t.start()
                pumps.append(t)
        failed: tuple[str, int] | None = None
        while True:
            codes = [p.poll() for p in procs]
            if failed is None:
                bad = [(cmd.label, rc) for cmd, rc in zip(plan.commands, codes) if rc not in (None, 0)]
                if bad:
                    failed = bad[0]
                    if len(procs) > 1 and any(rc is None for rc in codes):
                        with lock:
                            print(f"deepy: {failed[0]} exited with code {failed[1]}; stopping the other hosts",
                                  file=err, flush=True)
                        _stop_all(procs)
                        codes = [p.poll() for p in procs]
            if all(rc is not None for rc in codes):
                break
            time.sleep(0.05)
    except (KeyboardInterrupt, _Stop) as exc:
        with lock:
            print("deepy: interrupted; stopping every launched process", file=err, flush=True)
        _stop_all(procs)
        return 130 if isinstance(exc, KeyboardInterrupt) else 128 + int(exc.args[0])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for t in pumps:
            t.join(timeout=5)
    if failed is not None:
        code = failed[1] if failed[1] > 0 else 128 - failed[1]  # killed by signal n → 128 + n, as a shell reports
        if len(procs) > 1:
            print(f"error: {failed[0]} failed with exit code {code}; its output is above", file=err)
        return code
    return 0


def main(argv: list[str] | None = None) -> int:
    """``deepy.py``: returns the exit code; user errors print one line ``error: ...``."""
    try:
        args, command = parse_args(list(sys.argv[1:] if argv is None else argv))
        plan = build_plan(args, command, os.environ, os.getcwd())
        print(f"deepy: {plan.summary}", file=sys.stderr, flush=True)
        if args.dry_run:
            for cmd in plan.commands:
                print(shlex.join(cmd.argv))
            return 0
        return execute(plan)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
