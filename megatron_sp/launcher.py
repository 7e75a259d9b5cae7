"""The one launcher: ``deepy.py`` (one torchrun per host) and ``train.py``'s start of local ranks.

deepy: ``split_argv`` → hosts and environment (``multinode``) → ``build_plan`` (exact argv lists;
``--dry-run`` prints them) → ``execute``. ``start_local`` runs train.py's ranks. See docs/launcher.md.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .errors import LaunchError, UserError
from .multinode import (MAX_SLOTS, EnvSpec, Host, check_hostname, check_port_free, collect_env, env_prefix,
                        hosts_text, is_this_host, parse_hostfile, remote_command, select_hosts, slurm_hosts,
                        uniform_slots, with_devices)

LAUNCHERS = ("ssh", "pdsh", "slurm", "local")
DEFAULT_MASTER_PORT = 29500
ENV_FILE = ".deepy_env"
STOP_GRACE_S = 30.0  # after SIGTERM, how long a launched process may take to stop before SIGKILL
LOCAL_STOP_WAIT_S = 24 * 3600  # train.py's local ranks: time to finish the step and save after a stop signal
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

_OVERRIDE_RE = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*=")
log = logging.getLogger("megatron_sp")


# ----------------------------------------------------------------------------- command line

def _build_parser() -> argparse.ArgumentParser:
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
    return parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage block
        raise LaunchError(f"{message}; see python deepy.py --help")


def split_argv(argv: list[str], valued: set[str], known: set[str]) -> tuple[list[str], list[str]]:
    """(launcher options, [script, *script args]); which option is whose: docs/launcher.md."""
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
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else "; see python deepy.py --help"
            raise LaunchError(f"unknown option {name}{hint} (an option of the script goes after the script or "
                              "after '--')")
        own.append(tok)
        if name in valued and "=" not in tok and i < len(argv):
            own.append(argv[i])
            i += 1
    return own, command


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options and the script command (script and its arguments)."""
    parser = _build_parser()
    valued = {opt for action in parser._actions if action.nargs != 0 for opt in action.option_strings}
    own, command = split_argv(argv, valued, {opt for action in parser._actions for opt in action.option_strings})
    args = parser.parse_args(own)
    if not command:
        raise LaunchError("no script to launch; usage: python deepy.py [options] train.py --conf CONFIG [args]")
    if command[0].startswith("-"):
        raise LaunchError(f"script '{command[0]}' starts with '-' and would read as a torchrun option; "
                          f"write ./{command[0]}")
    return args, command

# ----------------------------------------------------------------------------- config

@dataclass(frozen=True)
class Layout:
    """The ranks a train.py config asks for: ``world`` (None when parallel.dp is derived) and tp·pp·cp."""

    source: str
    world: int | None
    model_parallel: int
    factors: str


def config_layout(script_args: list[str]) -> Layout | None:
    """The layout of the ``--conf`` files and dotted overrides in ``script_args`` (None without --conf; no torch)."""
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


# ----------------------------------------------------------------------------- torchrun

def torchrun_args(nnodes: int, nproc: int, rendezvous: list[str], command: list[str], module: bool = False,
                  max_restarts: int | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """torch.distributed.run's arguments (what follows ``python -m torch.distributed.run``), for every launch."""
    args = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc), *rendezvous, *extra]
    if max_restarts is not None:
        args += ["--max-restarts", str(max_restarts)]
    return args + (["--module"] if module else []) + command


# ----------------------------------------------------------------------------- plan

@dataclass
class Command:
    """One process deepy starts: ``label`` (host name, or the launcher) and its exact argv."""

    label: str
    argv: list[str]


@dataclass
class LaunchPlan:
    """What ``deepy`` runs: the ``launcher`` used, its ``commands``, a one-line ``summary`` and the ``rendezvous``
    (host, port) whose port must be free when that host is this one (--standalone: none)."""

    launcher: str
    commands: list[Command]
    summary: str
    rendezvous: tuple[str, int] | None = None


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

    def torchrun(self, nnodes: int, nproc: int, rendezvous: list[str]) -> list[str]:
        return [self.args.python, "-u", "-m", "torch.distributed.run",
                *torchrun_args(nnodes, nproc, rendezvous, self.command, self.args.module, self.args.max_restarts)]

    def c10d(self, addr: str) -> list[str]:
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{self.port}", "--rdzv-id", self.rdzv_id]

    def c10d_text(self, addr: str) -> str:
        return f"rendezvous c10d at {addr}:{self.port} (id {self.rdzv_id})"


def build_plan(args: argparse.Namespace, command: list[str], environ: Mapping[str, str], cwd: str) -> LaunchPlan:
    """The exact commands of the launch (nothing is run here, except ``scontrol`` under slurm)."""
    if not args.module and not Path(cwd, command[0]).is_file():
        raise LaunchError(f"script {command[0]!r} not found in {cwd}; give a path relative to the current directory "
                          "(or --module for a module name)")
    for flag, port in (("--master-port", args.master_port), ("--ssh-port", args.ssh_port)):
        if port is not None and not 1 <= port <= 65535:
            raise LaunchError(f"{flag} {port}: must be in 1..65535")
    if args.max_restarts is not None and not 0 <= args.max_restarts <= 1000:
        raise LaunchError(f"--max-restarts {args.max_restarts}: at most 1000 (and at least 0)")
    for flag, count in (("--nproc-per-node", args.nproc_per_node), ("--num-nodes", args.num_nodes)):
        if count is not None and count < 1:
            raise LaunchError(f"{flag} {count}: must be at least 1")
    if args.nproc_per_node is not None and args.nproc_per_node > MAX_SLOTS:
        raise LaunchError(f"--nproc-per-node {args.nproc_per_node}: more than {MAX_SLOTS} processes on one host; "
                          "give the number of devices per host")
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


def _one_command_ranks(req: _Request, launcher: str) -> tuple[int, dict[str, str]]:
    """(ranks per host or 0, environment) from the selected slots (the same on every host) or --nproc-per-node."""
    env = dict(req.env.explicit)
    if req.hosts:
        nproc, devices = uniform_slots(req.hosts, launcher)
        return nproc, with_devices(env, devices)
    return req.args.nproc_per_node or 0, env


def _plan_local(req: _Request) -> LaunchPlan:
    """torchrun on this machine: ``--standalone`` (a free port) unless --master-port is given."""
    args, hosts = req.args, req.hosts
    if len(hosts) > 1 or (args.num_nodes or 1) > 1:
        raise LaunchError(f"--launcher local starts ranks on this machine only, but {len(hosts) or args.num_nodes} "
                          "hosts are selected; use --launcher ssh/pdsh/slurm or select one host")
    nproc, env = _one_command_ranks(req, "local")
    if not nproc and req.layout is None:
        raise LaunchError(f"--nproc-per-node is needed: {req.command[0]} has no --conf to take the number of ranks from")
    if not nproc:
        nproc = req.layout.world or req.layout.model_parallel  # dp derived: 1, as train.py does on its own
    check_layout(req.layout, nproc, "on this machine")
    addr = args.master_addr or "127.0.0.1"
    rendezvous = ["--standalone"] if args.master_port is None else req.c10d(addr)
    where = "a free local port" if args.master_port is None else f"{addr}:{req.port}"
    argv = [*env_prefix(env), *req.torchrun(1, nproc, rendezvous)]
    return LaunchPlan("local", [Command("local", argv)], f"local launch of {req.command[0]}: {nproc} ranks on this machine, "
                      f"rendezvous on {where}", None if args.master_port is None else (addr, req.port))


def _plan_slurm(req: _Request, environ: Mapping[str, str]) -> LaunchPlan:
    """One srun step, one torchrun per node; this shell's environment goes along (--export=ALL)."""
    args, layout = req.args, req.layout
    nproc, env = _one_command_ranks(req, "slurm")
    names = [h.name for h in req.hosts]
    nodes = len(names)
    if not req.hosts:
        nodes_text = str(args.num_nodes or "") or environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
        if not nodes_text or not nodes_text.isdigit() or int(nodes_text) < 1:
            raise LaunchError("--launcher slurm without --hostfile needs --num-nodes (or a Slurm allocation: "
                              f"SLURM_JOB_NUM_NODES is {nodes_text or 'not set'})")
        nodes = int(nodes_text)
        names = [] if args.master_addr else slurm_hosts(environ)
        if names and len(names) < nodes:
            raise LaunchError(f"--num-nodes {nodes}: the Slurm allocation has only {len(names)} node(s)")
        names = names[:nodes]
        if not nproc and layout is not None and layout.world is not None and layout.world % nodes == 0:
            nproc = layout.world // nodes
        if not nproc:
            raise LaunchError(f"--nproc-per-node is needed: the ranks per node of {req.command[0]} on {nodes} Slurm node(s) "
                              "cannot be taken from the hostfile or the config")
    check_layout(layout, nodes * nproc, f"{nodes} node(s) × {nproc}")
    master = args.master_addr or names[0]
    srun = ["srun", "--nodes", str(nodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1", "--export=ALL"]
    if names:
        srun += ["--nodelist", ",".join(names)]
    argv = [*env_prefix(env), *srun, *req.torchrun(nodes, nproc, req.c10d(master))]
    return LaunchPlan("slurm", [Command("slurm", argv)],
                      f"slurm launch of {req.command[0]}: {nodes} node(s) × {nproc} ranks, {req.c10d_text(master)}",
                      (master, req.port))


def _plan_remote(req: _Request, launcher: str) -> LaunchPlan:
    """ssh (one command per host) or pdsh (one for all): a remote login shell runs a quoted command string."""
    args, hosts = req.args, req.hosts
    total = sum(h.nproc for h in hosts)
    check_layout(req.layout, total, hosts_text(hosts))
    master = args.master_addr or hosts[0].name
    env = req.env.remote()
    summary = f"{launcher} launch of {req.command[0]}: {len(hosts)} host(s) ({hosts_text(hosts)}), {total} ranks, "
    if launcher == "pdsh":
        nproc, devices = uniform_slots(hosts, "pdsh")
        remote = remote_command(req.cwd, with_devices(env, devices), req.torchrun(len(hosts), nproc, req.c10d(master)))
        pdsh = ["pdsh", "-R", "ssh", "-S", "-f", "1024", "-w", ",".join(h.name for h in hosts)]
        # pdsh substitutes %h, %u, %n in the command it runs and turns %% into %
        return LaunchPlan("pdsh", [Command("pdsh", [*pdsh, remote.replace("%", "%%")])],
                          summary + req.c10d_text(master), (master, req.port))
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
        argv = req.torchrun(len(hosts), h.nproc, rendezvous)
        remote = remote_command(req.cwd, with_devices(env, h.visible_devices), argv)
        commands.append(Command(h.name, [*ssh, "--", h.name, remote]))
    how = f"static rendezvous at {master}:{req.port}" if args.rdzv_backend == "static" else req.c10d_text(master)
    return LaunchPlan("ssh", commands, summary + how, (master, req.port))


# ----------------------------------------------------------------------------- execution

class _Stop(Exception):
    """SIGTERM (or SIGHUP) reached deepy: stop what it started."""


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def _stop_all(procs: list[subprocess.Popen], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to each running process group, SIGKILL after ``grace`` seconds (at once on a second Ctrl-C)."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with contextlib.suppress(KeyboardInterrupt):
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
            p.wait()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)  # the child's own session: its process group id is its pid


def _pump(label: str, stream: Any, out: TextIO, lock: threading.Lock) -> None:
    """Copy ``stream`` to ``out`` line by line, prefixed ``label: `` (the \\r of ssh -tt's terminal dropped)."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n").replace("\r", "")
        with lock:
            out.write(f"{label}: {line}\n")
            out.flush()
    stream.close()


def execute(plan: LaunchPlan, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the plan's commands, each in its own session; return the first failing one's exit code (130 on Ctrl-C).
    Ctrl-C, SIGTERM or a failing host stops the others."""
    out, err = out or sys.stdout, err or sys.stderr
    prefix = plan.launcher == "ssh"  # ssh output gets a host prefix; the others keep the terminal
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGHUP)} if in_main else {}
    try:
        for cmd in plan.commands:
            try:
                p = subprocess.Popen(cmd.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if prefix else None,
                                     stderr=subprocess.STDOUT if prefix else None, start_new_session=True)
            except OSError as exc:
                _stop_all(procs)
                raise LaunchError(f"cannot start {cmd.argv[0]!r} ({exc.strerror}); install it or choose another "
                                  "--launcher") from None
            procs.append(p)
            if prefix:
                pumps.append(threading.Thread(target=_pump, args=(cmd.label, p.stdout, out, lock), daemon=True))
                pumps[-1].start()
        while True:
            codes = [p.poll() for p in procs]
            failed = next(((cmd.label, rc) for cmd, rc in zip(plan.commands, codes) if rc not in (None, 0)), None)
            if failed is not None or None not in codes:
                break
            time.sleep(0.05)
        if failed is not None and None in codes:
            with lock:
                print(f"deepy: {failed[0]} exited with code {failed[1]}; stopping the other hosts", file=err, flush=True)
            _stop_all(procs)
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
    if failed is None:
        return 0
    code = failed[1] if failed[1] > 0 else 128 - failed[1]  # killed by signal n → 128 + n, as a shell reports
    if len(procs) > 1:
        print(f"error: {failed[0]} failed with exit code {code}; its output is above", file=err)
    return code


# ----------------------------------------------------------------------------- train.py's local ranks

def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started (all of ``TORCHRUN_ENV`` set; none: run plainly); a
    partial set is a ``LaunchError`` naming what is missing (else a plain run would start ranks of its own)."""
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing and len(missing) < len(TORCHRUN_ENV):
        given = [k for k in TORCHRUN_ENV if k not in missing]
        raise LaunchError(f"a partial torchrun environment: {', '.join(given)} set but {', '.join(missing)} not; "
                          f"launch with torchrun (it sets all {len(TORCHRUN_ENV)}), or unset {', '.join(given)} to "
                          "run plainly")
    return not missing


def single_rank_env() -> None:
    """The environment of a one-rank torchrun on a free local port (train.py at world size 1)."""
    from .testing import free_port

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})


def start_local(nproc: int, argv: list[str], log_dir: Path, save_dir: str | None, cpu: bool,
                memory_note: str | None = None) -> int:
    """Run ``nproc`` local ranks of this script (else the repository's train.py) with torch.distributed.run in this
    process; return the exit code (docs/launcher.md, "train.py run plainly"). ``memory_note``: the planner's memory
    estimate, named when a rank is killed by SIGKILL."""
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from .faults import StopRelay, last_checkpoint, watch_stop_signals

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc) if cpu else 1))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # the ranks write to files shown on the console: line by line
    main_script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else ""
    script = os.path.abspath(main_script) if main_script else str(Path(__file__).resolve().parents[1] / "train.py")
    # --standalone spelled out (a c10d store on a free port), with a readable id: it names the per-rank log directory
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                  "--rdzv-id", f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"]
    args = torch_run.parse_args(torchrun_args(1, nproc, rendezvous, [script, *argv],
                                              extra=("--log-dir", str(log_dir), "--shutdown-timeout",
                                                     str(LOCAL_STOP_WAIT_S))))
    config, entrypoint, entry_args = torch_run.config_from_args(args)
    logs = _rank_logs(log_dir)
    config.logs_specs = logs
    log.info("starting %d local ranks (torch.distributed.run --standalone --nproc-per-node %d; their output also in "
             "%s)", nproc, nproc, log_dir)
    for name in [n for n in logging.Logger.manager.loggerDict if n.startswith("torch.distributed.elastic")]:
        logging.getLogger(name).setLevel(logging.CRITICAL)  # our one line names the failure (each sets its own level)
    relay = StopRelay()
    in_main = threading.current_thread() is threading.main_thread()
    if in_main:
        watch_stop_signals(relay)
    try:
        try:
            elastic_launch(config, entrypoint)(*entry_args)
            return 0
        finally:
            logs.close()  # the ranks' last lines reach the console before our own
            if in_main:
                watch_stop_signals(None)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if code == -signal.SIGKILL:
            how = ("was killed by signal SIGKILL, probably out of memory ("
                   + (f"the kernel's OOM killer; {memory_note})" if memory_note else "killed by the kernel)"))
        else:
            how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        print(f"error: rank {rank} of {nproc} {how}; the other ranks were stopped"
              + ("" if code < 0 else " (its message is above)"), file=sys.stderr)
        return code if code > 0 else 1
    except SignalException as exc:
        first = relay.first or signal.Signals(exc.sigval)
        kept = last_checkpoint(save_dir) if save_dir else None
        if relay.at_once:
            print("interrupted: the ranks were stopped at once without saving"
                  + (f"; the last checkpoint is {kept}" if kept else ""), file=sys.stderr)
            return 130
        latest = Path(save_dir) / "latest" if save_dir else None
        if kept and latest is not None and relay.first is not None and latest.stat().st_mtime >= relay.first_at:
            log.info("stopped by %s; the ranks saved %s", first.name, kept)
            return 0 if first == signal.SIGTERM else 130
        print(f"error: stopped by signal {first.name} without a new checkpoint"
              + ("" if save_dir else " (set checkpoint.save to save one on SIGTERM or Ctrl-C)"), file=sys.stderr)
        return 128 + int(first)


def _rank_logs(log_dir: Path) -> Any:
    """Each rank's stdout and stderr in files under ``log_dir`` (torchrun's ``<rdzv id>_<random>/attempt_<n>/<local
    rank>/stdout.log, stderr.log``), shown on the console as they grow, like torchrun's ``--tee 3`` but without its
    ``[default0]:`` line prefixes: rank 0 logs plainly and the other ranks tag their own lines (``[rank N]``), so the
    console reads as if the ranks wrote to it. ``close()`` (after the launch) prints what is left."""
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest, Std
    from torch.distributed.elastic.multiprocessing.tail_log import TailLog

    class RankLogs(DefaultLogsSpecs):
        def __init__(self) -> None:
            super().__init__(log_dir=str(log_dir), redirects=Std.ALL, tee=Std.NONE)
            self.tails: list[TailLog] = []

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            dest = super().reify(envs)
            self.close()  # a restart's new attempt: the previous attempt's files are complete
            self.tails = [TailLog("rank", files, stream, dict.fromkeys(files, "")).start()
                          for files, stream in ((dest.stdouts, sys.stdout), (dest.stderrs, sys.stderr))]
            return dest

        def close(self) -> None:
            for tail in self.tails:
                tail.stop()
            self.tails = []

    return RankLogs()


def main(argv: list[str] | None = None) -> int:
    """``deepy.py``: returns the exit code; user errors print one line ``error: ...``."""
    try:
        args, command = parse_args(list(sys.argv[1:] if argv is None else argv))
        plan = build_plan(args, command, os.environ, os.getcwd())
        if not args.dry_run and plan.rendezvous and is_this_host(plan.rendezvous[0]):
            check_port_free(plan.rendezvous[1], plan.rendezvous[0])  # taken: torchrun would join or hang, silently
        print(f"deepy: {plan.summary}", file=sys.stderr, flush=True)
        if args.dry_run:
            for cmd in plan.commands:
                print(shlex.join(cmd.argv))
            return 0
        return execute(plan)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
