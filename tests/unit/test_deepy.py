"""deepy.py, the multi-node launcher (megatron_sp/launcher.py).

Dry runs of every launcher are parsed back with ``shlex.split`` (and, for ssh/pdsh, the remote
command string a second time, as the remote shell would) and compared token by token. Hostile
hostnames must be refused; hostile paths, arguments and environment values must come back as the
exact original tokens and create no file. Two tests run for real: the local launcher (torchrun with
2 ranks) and the ssh launcher through a fake ``ssh`` that hands the command string to ``bash -c`` in a
clean environment, so the quoting goes through a real shell.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_sp import launcher, multinode
from megatron_sp.errors import LaunchError
from megatron_sp.multinode import Host, parse_hostfile, select_hosts

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = ["-u", "-m", "torch.distributed.run"]

# Arguments a shell would act on if they were not quoted; each must reach the script unchanged.
HOSTILE_ARGS = ["$(touch pwned_dollar)", "`touch pwned_tick`", "a;touch pwned_semi", "x && touch pwned_and",
                "it's \"quoted\"", "two words", "", "*", "~", "line1\nline2", "50%n %h %% %u", "--tag=$HOME"]
HOSTILE_ENV = "v; touch pwned_env $(touch pwned_env2) 'q' \"d\""

WORKER = """import json, os, sys
print("RESULT " + json.dumps({"rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "argv": sys.argv[1:],
                              "val": os.environ.get("DEEPY_T"), "nccl": os.environ.get("NCCL_DEEPY_TEST")}), flush=True)
"""


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean working directory with a script and a hostfile; no propagated variables from this shell."""
    for key in list(os.environ):
        if key.startswith(multinode.AUTO_ENV_PREFIXES) or key in multinode.AUTO_ENV_NAMES or key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my dir").mkdir()
    (tmp_path / "my dir" / "w.py").write_text(WORKER)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "hosts").write_text("# two nodes\nnode1 slots=4\n\nnode2 slots=4   # the second\n")
    (tmp_path / "tp2dp2.yml").write_text("parallel:\n  tp: 2\n  dp: 2\n")
    (tmp_path / "tp2.yml").write_text("parallel:\n  tp: 2\n")
    (tmp_path / "badhosts").write_text("node1 slots=1\nnode2;touch${IFS}pwned slots=1\n")
    return tmp_path


def dry(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[list[str]]:
    """Run deepy --dry-run in-process; every printed command as an argv list."""
    rc = launcher.main(["--dry-run", "--rdzv-id", "RID", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert err.startswith("deepy: ")
    return commands(out)


def commands(out: str) -> list[list[str]]:
    """One argv per printed command (a quoted argument may hold a newline: join lines until they parse)."""
    parsed, pending = [], ""
    for line in out.splitlines(keepends=True):
        pending += line
        try:
            parsed.append(shlex.split(pending))
        except ValueError:  # an open quote: the command goes on
            continue
        pending = ""
    assert not pending, pending
    return parsed


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run deepy --dry-run expecting a one-line user error; return it."""
    rc = launcher.main(["--dry-run", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def remote_argv(command: str, cwd: Path) -> tuple[dict[str, str], list[str]]:
    """The remote shell's view of ``cd CWD && exec env K=V ... argv``: (env, argv)."""
    tokens = shlex.split(command)
    assert tokens[:4] == ["cd", str(cwd), "&&", "exec"]
    tokens = tokens[4:]
    env: dict[str, str] = {}
    if tokens[0] == "env":
        tokens = tokens[1:]
        while "=" in tokens[0] and not tokens[0].startswith("/"):
            key, value = tokens.pop(0).split("=", 1)
            env[key] = value
    return env, tokens


def torchrun_argv(nnodes: int, nproc: int, rendezvous: list[str], command: list[str]) -> list[str]:
    return [sys.executable, *TORCHRUN, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), *rendezvous, *command]


def c10d(endpoint: str) -> list[str]:
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "RID"]


def no_side_effects(*dirs: Path) -> None:
    for d in dirs:
        assert not list(d.glob("pwned*")), list(d.glob("pwned*"))


# ----------------------------------------------------------------------------- hostfile, include/exclude

def test_hostfile_parsing(work: Path) -> None:
    assert parse_hostfile(work / "hosts") == {"node1": 4, "node2": 4}
    assert list(parse_hostfile(work / "hosts")) == ["node1", "node2"]  # file order


@pytest.mark.parametrize("text, line, words", [
    ("node1 slots=2\nnode2\n", 2, "expected 'host slots=N'"),
    ("node1 slots=2 extra\n", 1, "expected 'host slots=N'"),
    ("node1 gpus=2\n", 1, "expected 'host slots=N'"),
    ("# c\nnode1 slots=two\n", 2, "not an integer"),
    ("node1 slots=0\n", 1, "at least 1 slot"),
    ("node1 slots=2\nnode1 slots=2\n", 2, "listed twice"),
    ("h;touch_pwned slots=1\n", 1, "not allowed"),
    ("$(touch_pwned) slots=1\n", 1, "not allowed"),
    ("`touch_pwned` slots=1\n", 1, "not allowed"),
    ("-oProxyCommand=touch_pwned slots=1\n", 1, "not allowed"),
    ("user@node1 slots=1\n", 1, "not allowed"),
    ("node1 slots=100000000000000000000\n", 1, "more than 1024 processes on one host"),  # ate 23.5 GB before
    ("NODE1 slots=2\nnode1 slots=2\n", 2, "listed twice"),  # DNS names are case-insensitive
    ("node1 slots=2\nnode1. slots=2\n", 2, "listed twice"),  # a trailing '.' is the same host
    ("node1 slots=2\n\xff\xfe slots=1\n", 2, "not UTF-8 text"),
])
def test_hostfile_errors_name_the_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = tmp_path / "hosts"
    path.write_bytes(text.encode("latin-1"))  # "\xff" stays one byte: not UTF-8
    with pytest.raises(LaunchError, match=words) as info:
        parse_hostfile(path)
    assert f"{path}:{line}:" in str(info.value)


def test_hostfile_names_are_normalised(tmp_path: Path) -> None:
    (tmp_path / "hosts").write_text("Node1.Example.COM. slots=2\nNODE2 slots=1\n")
    assert parse_hostfile(tmp_path / "hosts") == {"node1.example.com": 2, "node2": 1}
    assert [h.name for h in select_hosts({"node1": 2, "node2": 1}, "hosts", include="NODE2.")] == ["node2"]


def test_hostfile_missing_or_empty(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="not found"):
        parse_hostfile(tmp_path / "nope")
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(LaunchError, match="no hosts"):
        parse_hostfile(tmp_path / "empty")


POOL = {"a": 4, "b": 4, "c": 2}


@pytest.mark.parametrize("kwargs, expected", [
    ({}, [Host("a", (0, 1, 2, 3)), Host("b", (0, 1, 2, 3)), Host("c", (0, 1))]),
    ({"include": "c@a"}, [Host("a", (0, 1, 2, 3)), Host("c", (0, 1))]),  # hostfile order
    ({"include": "b:3,1"}, [Host("b", (1, 3))]),
    ({"exclude": "a"}, [Host("b", (0, 1, 2, 3)), Host("c", (0, 1))]),
    ({"exclude": "b:0@c:0,1"}, [Host("a", (0, 1, 2, 3)), Host("b", (1, 2, 3))]),
    ({"num_nodes": 2}, [Host("a", (0, 1, 2, 3)), Host("b", (0, 1, 2, 3))]),
    ({"nproc_per_node": 2}, [Host("a", (0, 1)), Host("b", (0, 1)), Host("c", (0, 1))]),
    ({"exclude": "a:0", "num_nodes": 1, "nproc_per_node": 2}, [Host("a", (1, 2))]),
])
def test_select_hosts(kwargs: dict, expected: list[Host]) -> None:
    assert select_hosts(POOL, "hosts", **kwargs) == expected


def test_visible_devices_only_for_a_slot_subset() -> None:
    assert Host("a", (0, 1)).visible_devices is None
    assert Host("a", (1, 3)).visible_devices == "1,3"


@pytest.mark.parametrize("kwargs, words", [
    ({"include": "a", "exclude": "b"}, "cannot be combined"),
    ({"include": "zz"}, "not in --hostfile hosts"),
    ({"include": "a@a"}, "appears twice"),
    ({"include": "a:4"}, "slot 4 of a is out of range"),
    ({"include": "a:x"}, "comma-separated integers"),
    ({"include": "a@"}, "empty host entry"),
    ({"include": "h;touch_pwned"}, "not allowed"),
    ({"exclude": "a@b@c"}, "leaves no host"),
    ({"num_nodes": 4}, "only 3 host"),
    ({"nproc_per_node": 3}, "host c has only 2 slot"),
])
def test_select_hosts_errors(kwargs: dict, words: str) -> None:
    with pytest.raises(LaunchError, match=words):
        select_hosts(POOL, "hosts", **kwargs)


# ----------------------------------------------------------------------------- dry runs

def test_dry_run_ssh(work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("WANDB_PROJECT", "my project")
    monkeypatch.setenv("PYTHONPATH", "/opt/x y")
    monkeypatch.setenv("UNRELATED_SECRET", "no")
    monkeypatch.setenv("FROM_SHELL", "here")
    # launcher options after the script are the launcher's; everything after -- is the script's
    cmds = dry(["train.py", "--conf", "tp2dp2.yml", "--hostfile", "hosts", "--nproc-per-node=2", "--env", "FROM_SHELL",
                "--env", "K=v", "--max-restarts", "2", "--", "--dry-run", "--hostfile", "x"], capsys)
    assert len(cmds) == 2
    for host, argv in zip(["node1", "node2"], cmds):
        assert argv[:-2] == ["ssh", "-tt", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "--"] and argv[-2] == host
        env, remote = remote_argv(argv[-1], work)
        assert env == {"NCCL_SOCKET_IFNAME": "eth0", "PYTHONPATH": "/opt/x y", "WANDB_PROJECT": "my project",
                       "FROM_SHELL": "here", "K": "v"}
        assert remote == [sys.executable, *TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", *c10d("node1:29500"),
                          "--max-restarts", "2", "train.py", "--conf", "tp2dp2.yml", "--dry-run", "--hostfile", "x"]


def test_dry_run_ssh_static_ranks_slots_and_ports(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cmds = dry(["--hostfile", "hosts", "--rdzv-backend", "static", "--master-port", "1234", "--ssh-port", "2222",
                "--include", "node1:2,3@node2", "train.py", "--conf", "tp2.yml"], capsys)
    for rank, argv in enumerate(cmds):
        assert argv[:9] == ["ssh", "-tt", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-p", "2222", "--"]
        env, remote = remote_argv(argv[-1], work)
        nproc = 2 if rank == 0 else 4
        assert env == ({"CUDA_VISIBLE_DEVICES": "2,3"} if rank == 0 else {})
        assert remote == torchrun_argv(2, nproc, ["--node-rank", str(rank), "--master-addr", "node1", "--master-port",
                                                  "1234"], ["train.py", "--conf", "tp2.yml"])


def test_dry_run_pdsh(work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    [argv] = dry(["--launcher", "pdsh", "--hostfile", "hosts", "--master-addr", "10.0.0.1", "--exclude", "node1:0@node2:0",
                  "train.py", "--conf", "tp2.yml", *HOSTILE_ARGS, "--env", f"DEEPY_T={HOSTILE_ENV}"], capsys)
    assert argv[:-1] == ["pdsh", "-R", "ssh", "-S", "-f", "1024", "-w", "node1,node2"]
    # pdsh turns %% into % (and would expand a lone %n/%h/%u); the remote shell then parses the string
    assert "%n" not in argv[-1].replace("%%", "")
    env, remote = remote_argv(argv[-1].replace("%%", "%"), work)
    assert env == {"WANDB_MODE": "offline", "DEEPY_T": HOSTILE_ENV, "CUDA_VISIBLE_DEVICES": "1,2,3"}
    assert remote == torchrun_argv(2, 3, c10d("10.0.0.1:29500"), ["train.py", "--conf", "tp2.yml", *HOSTILE_ARGS])
    no_side_effects(work)


def test_pdsh_needs_the_same_slots_everywhere(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fails(["--launcher", "pdsh", "--hostfile", "hosts", "--include", "node1:0@node2", "train.py"], capsys)
    assert "node1:0, node2:0,1,2,3" in err and "--launcher ssh" in err


def test_dry_run_slurm_with_hostfile(work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # inherited by srun (--export=ALL), not repeated
    [argv] = dry(["--launcher", "slurm", "--hostfile", "hosts", "--nproc-per-node", "2", "--env", "A=1;2",
                  "train.py", "--conf", "tp2.yml"], capsys)
    assert argv == ["env", "A=1;2", "srun", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                    "--export=ALL", "--nodelist", "node1,node2",
                    *torchrun_argv(2, 2, c10d("node1:29500"), ["train.py", "--conf", "tp2.yml"])]


def test_dry_run_slurm_allocation(work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = work / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text('#!/bin/sh\n[ "$3" = "gpu[07-09]" ] && printf "gpu07\\ngpu08\\ngpu09\\n"\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-09]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    # two of the three nodes; ranks per node from the config: tp2·dp2 = 4 ranks over 2 nodes
    rc = launcher.main(["--dry-run", "--launcher", "slurm", "--num-nodes", "2", "train.py", "--conf", "tp2dp2.yml"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert commands(out) == [["srun", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1", "--export=ALL",
                                "--nodelist", "gpu07,gpu08", sys.executable, *TORCHRUN, "--nnodes", "2",
                                "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "gpu07:29500",
                                "--rdzv-id", "4242", "train.py", "--conf", "tp2dp2.yml"]]
    assert "--nproc-per-node is needed" in fails(["--launcher", "slurm", "train.py", "--conf", "tp2.yml"], capsys)
    monkeypatch.delenv("SLURM_JOB_NUM_NODES")
    assert "needs --num-nodes" in fails(["--launcher", "slurm", "train.py"], capsys)


def test_dry_run_local(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    standalone = ["--standalone"]
    assert dry(["train.py", "--conf", "tp2dp2.yml"], capsys) == [
        torchrun_argv(1, 4, standalone, ["train.py", "--conf", "tp2dp2.yml"])]
    # dp derived → 1 rank per model replica, as train.py run plainly; a dotted override counts
    assert dry(["train.py", "--conf", "tp2.yml"], capsys)[0][:8] == torchrun_argv(1, 2, [], [])
    assert dry(["train.py", "--conf", "tp2dp2.yml", "parallel.dp=3"], capsys)[0][:8] == torchrun_argv(1, 6, [], [])
    assert dry(["--nproc-per-node", "3", "--module", "--env", "X=1", "pkg.mod", "a"], capsys) == [
        ["env", "X=1", *torchrun_argv(1, 3, [*standalone, "--module"], ["pkg.mod", "a"])]]
    assert dry(["--master-port", "6000", "--nproc-per-node", "2", "train.py"], capsys) == [
        torchrun_argv(1, 2, c10d("127.0.0.1:6000"), ["train.py"])]
    # one host of a hostfile with a slot selection
    assert dry(["--launcher", "local", "--hostfile", "hosts", "--include", "node2:1,2", "train.py"], capsys) == [
        ["env", "CUDA_VISIBLE_DEVICES=1,2", *torchrun_argv(1, 2, standalone, ["train.py"])]]


@pytest.mark.parametrize("argv, words", [
    (["train.py"], "--nproc-per-node is needed"),
    (["--hostfile", "hosts", "train.py", "--conf", "tp2dp2.yml"], "the launch gives 8 ranks (node1×4, node2×4) but "
                                                                  "tp2dp2.yml asks for tp·pp·cp·dp = 2·1·1·2 = 4; set parallel.dp=4"),
    (["--hostfile", "hosts", "--num-nodes", "1", "--nproc-per-node", "3", "train.py", "--conf", "tp2.yml"],
     "the launch gives 3 ranks (node1×3), not a multiple of tp·pp·cp = 2"),
    (["--nproc-per-node", "3", "train.py", "--conf", "tp2dp2.yml"], "the launch gives 3 ranks (on this machine)"),
    (["--launcher", "local", "--hostfile", "hosts", "train.py"], "this machine only"),
    (["--launcher", "ssh", "train.py"], "needs --hostfile"),
    (["--include", "node1", "train.py"], "select hosts and slots of a --hostfile"),
    (["--launcher", "pdsh", "--hostfile", "hosts", "--rdzv-backend", "static", "train.py"], "only --launcher ssh"),
    (["--hostfle", "hosts", "train.py"], "unknown option --hostfle; did you mean --hostfile?"),
    (["--launcher", "mpi", "train.py"], "invalid choice: 'mpi'"),
    (["--master-port", "x", "train.py"], "invalid int value"),
    (["--master-port", "70000", "--nproc-per-node", "1", "train.py"], "--master-port 70000: must be in 1..65535"),
    (["--num-nodes", "0", "train.py"], "--num-nodes 0: must be at least 1"),
    (["--nproc-per-node", "1000000000000", "train.py"], "more than 1024 processes on one host"),
    (["--nproc-per-node", "1", "--max-restarts", "100000000000", "train.py"], "--max-restarts 100000000000: at most 1000"),
    ([], "no script to launch"),
    (["--", "-x.py"], "starts with '-'"),
    (["missing.py", "--nproc-per-node", "1"], "script 'missing.py' not found"),
    (["--nproc-per-node", "1", "--env", "A;touch pwned=1", "train.py"], "not a valid environment variable name"),
    (["--nproc-per-node", "1", "--env", "DEEPY_UNSET_VAR", "train.py"], "DEEPY_UNSET_VAR is not set in this shell"),
    (["--hostfile", "hosts", "--master-addr", "h;touch pwned", "train.py"], "--master-addr: host name"),
    (["--hostfile", "hosts", "--master-addr=-oProxyCommand=x", "train.py"], "not allowed"),
    (["--nproc-per-node", "1", "train.py", "--conf", "nope.yml"], "config file 'nope.yml' not found"),
    (["--hostfile", "badhosts", "train.py"], "badhosts:2: host name 'node2;touch${IFS}pwned' is not allowed"),
])
def test_user_errors_are_one_line(work: Path, capsys: pytest.CaptureFixture[str], argv: list[str], words: str) -> None:
    assert words in fails(argv, capsys)
    no_side_effects(work)


def test_deepy_env_file(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (work / ".deepy_env").write_text("# for every rank\nNCCL_IB_HCA = mlx5_0\nK=a=b; c\n\n")
    [argv] = dry(["--hostfile", "hosts", "--num-nodes", "1", "--env", "K=override", "train.py"], capsys)
    assert remote_argv(argv[-1], work)[0] == {"NCCL_IB_HCA": "mlx5_0", "K": "override"}
    (work / ".deepy_env").write_text("GOOD=1\nno equals sign\n")
    assert f"{work / '.deepy_env'}:2: expected KEY=VALUE" in fails(["--nproc-per-node", "1", "train.py"], capsys)
    (work / ".deepy_env").write_bytes(b"GOOD=1\nBAD=\x80\x81\n")
    assert f"{work / '.deepy_env'}:2: not UTF-8 text" in fails(["--nproc-per-node", "1", "train.py"], capsys)


def test_hostile_values_survive_the_remote_shell(work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config path and arguments full of shell syntax come back, token for token, after the remote shell's parsing."""
    conf = "conf dir $(touch pwned_conf) `touch pwned_conf2` it's.yml"
    (work / conf).write_text("parallel:\n  tp: 2\n")
    script = "my dir/w.py"
    cmds = dry(["--hostfile", "hosts", "--env", f"DEEPY_T={HOSTILE_ENV}", script, "--conf", conf, *HOSTILE_ARGS], capsys)
    for argv in cmds:
        env, remote = remote_argv(argv[-1], work)
        assert env["DEEPY_T"] == HOSTILE_ENV
        assert remote[-(3 + len(HOSTILE_ARGS)):] == [script, "--conf", conf, *HOSTILE_ARGS]
    no_side_effects(work)


# ----------------------------------------------------------------------------- real launches

def test_missing_launcher_program_is_a_user_error(work: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(work))  # no pdsh there
    assert launcher.main(["--launcher", "pdsh", "--hostfile", "hosts", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: cannot start 'pdsh'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _results(stdout: str) -> list[dict]:
    # Ranks share the terminal and `python -u` writes a print's text and its newline separately, so
    # two ranks' lines can meet on one line: decode each JSON object after its marker instead.
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(part)[0] for part in stdout.split("RESULT ")[1:]]


def _deepy(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "deepy.py"), *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_local_launch_runs(work: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = _deepy(["--nproc-per-node", "2", "my dir/w.py", *HOSTILE_ARGS, "--env", f"DEEPY_T={HOSTILE_ENV}"],
                  work, env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    results = _results(proc.stdout)
    assert sorted(r["rank"] for r in results) == ["0", "1"]
    assert all(r["argv"] == HOSTILE_ARGS and r["val"] == HOSTILE_ENV and r["world"] == "2" for r in results)
    no_side_effects(work, ROOT)


FAKE_SSH = """#!/bin/bash
# Stand-in for ssh: skip the options, then let bash parse the command string, as a remote login shell
# would, in a clean environment (only PATH, HOME and the target host name).
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p) shift 2 ;;
    --) shift; break ;;
    -*) shift ;;
    *) break ;;
  esac
done
host="$1"; shift
exec env -i PATH="$PATH" HOME="$HOME" FAKE_HOST="$host" bash -c "$*"
"""


@pytest.fixture
def fake_ssh(work: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


def test_ssh_launch_runs_through_a_real_shell(work: Path, fake_ssh: dict[str, str]) -> None:
    (work / "hosts2").write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    env = {**fake_ssh, "NCCL_DEEPY_TEST": "a b;c"}  # propagated by name (the fake ssh starts from env -i)
    proc = _deepy(["--hostfile", "hosts2", "--master-port", str(_free_port()), "my dir/w.py", *HOSTILE_ARGS,
                   "--env", f"DEEPY_T={HOSTILE_ENV}"], work, env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = _results(proc.stdout)
    assert sorted(r["rank"] for r in results) == ["0", "1"], proc.stdout
    for r in results:
        assert r["argv"] == HOSTILE_ARGS and r["val"] == HOSTILE_ENV and r["nccl"] == "a b;c" and r["world"] == "2"
    hosts = {line.split(": ", 1)[0] for line in proc.stdout.splitlines() if "RESULT " in line}
    assert hosts == {"localhost", "127.0.0.1"}  # every line prefixed by its host
    no_side_effects(work, ROOT)


def test_ssh_failing_host_stops_the_others(work: Path, fake_ssh: dict[str, str]) -> None:
    fake_python = work / "bin" / "fakepython"
    fake_python.write_text('#!/bin/bash\nif [ "$FAKE_HOST" = bad ]; then echo "giving up"; exit 3; fi\nexec sleep 60\n')
    fake_python.chmod(0o755)
    (work / "hosts3").write_text("good slots=1\nbad slots=1\n")
    start = time.monotonic()
    proc = _deepy(["--hostfile", "hosts3", "--python", str(fake_python), "my dir/w.py"], work, fake_ssh, timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "bad: giving up" in proc.stdout
    assert "error: bad failed with exit code 3" in proc.stderr
    assert time.monotonic() - start < 20  # the good host's command was stopped, not waited for


def _default_sigint() -> None:
    """A shell's background job (CI runners) ignores SIGINT and its children inherit that, so Python
    would never raise KeyboardInterrupt: give deepy the default disposition, as a terminal would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ssh_interrupt_stops_every_host(work: Path, fake_ssh: dict[str, str]) -> None:
    fake_python = work / "bin" / "fakepython"
    fake_python.write_text('#!/bin/bash\necho $$ > "pid_$FAKE_HOST"\nexec sleep 60\n')
    fake_python.chmod(0o755)
    (work / "hosts4").write_text("h1 slots=1\nh2 slots=1\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / "deepy.py"), "--hostfile", "hosts4", "--python", str(fake_python),
                             "my dir/w.py"], cwd=work, env=fake_ssh, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    deadline = time.monotonic() + 20
    while not ((work / "pid_h1").exists() and (work / "pid_h2").exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "interrupted" in err
    for host in ("h1", "h2"):
        with pytest.raises(ProcessLookupError):
            os.kill(int((work / f"pid_{host}").read_text()), 0)


def test_torchrun_reports_a_config_error_as_its_root_cause(tmp_path: Path) -> None:
    """Under plain torchrun a rank's one ``error:`` line also goes to torchelastic's error file, so torchrun's
    ChildFailedError report names it as the root cause instead of "To enable traceback see: ..."."""
    env = {k: v for k, v in os.environ.items() if k not in (*launcher.TORCHRUN_ENV, "TORCHELASTIC_ERROR_FILE")}
    p = subprocess.run([sys.executable, *TORCHRUN, "--nproc-per-node", "1", "--log-dir", str(tmp_path), "train.py",
                        "--conf", "configs/demo.yml", "bad.key=1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env)
    line = "error: override 'bad.key=1': unknown section 'bad'; known keys: checkpoint, data, logging"
    assert p.returncode == 1 and any(s.startswith(line) for s in p.stderr.splitlines()), p.stderr
    assert f"  traceback : {line}" in p.stderr and "To enable traceback" not in p.stderr, p.stderr


# ----------------------------------------------------------------------------- a taken port, a partial environment

@pytest.mark.parametrize("launch", [["--nproc-per-node", "1"], ["--hostfile", "localhost_hosts"]])
def test_a_taken_master_port_fails_at_once_naming_it(work: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch, launch: list[str]) -> None:
    """The rendezvous port of a launch served by this host (local, or a hostfile whose master is this machine) is
    bound by another process: one line naming the port, before anything starts (torchrun would join it or hang)."""
    (work / "localhost_hosts").write_text("localhost slots=1\n")
    monkeypatch.setattr(launcher, "execute", lambda *_: pytest.fail("the launch started"))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        start = time.monotonic()
        rc = launcher.main(["--master-port", str(port), *launch, "train.py"])
        err = capsys.readouterr().err
    assert rc == 2 and time.monotonic() - start < 5, err
    assert err.count("\n") == 1 and f"the rendezvous port {port} is in use on" in err and "Traceback" not in err, err
    assert launcher.main(["--dry-run", "--master-port", str(port), *launch, "train.py"]) == 0  # prints, starts nothing
    assert multinode.is_this_host("localhost") and not multinode.is_this_host("node1.invalid")


@pytest.mark.parametrize("present", [("RANK", "WORLD_SIZE"), ("MASTER_ADDR",)])
def test_a_partial_torchrun_environment_is_refused_naming_what_is_missing(
        present: tuple[str, ...], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """RANK and WORLD_SIZE without MASTER_ADDR (...) would start a job of its own: train.py and the tools refuse."""
    import importlib.util

    import train

    for var in launcher.TORCHRUN_ENV:
        monkeypatch.delenv(var, raising=False)
    assert launcher.under_torchrun() is False
    for var in present:
        monkeypatch.setenv(var, "0")
    missing = [v for v in launcher.TORCHRUN_ENV if v not in present]
    spec = importlib.util.spec_from_file_location("generate_tool", ROOT / "tools" / "generate.py")
    tool = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(tool)  # type: ignore[union-attr]
    # the ranks' argv gets train.preflight=false appended, after options: overrides may come between options
    assert train.parse_args(["--conf", "a", "x.y=1", "--conf", "b", "z.w=2"]).overrides == ["x.y=1", "z.w=2"]
    assert tool.parse_args(["--load", "c", "x.y=1", "--json", "--prompt", "p", "z.w=2"]).overrides == ["x.y=1", "z.w=2"]
    for main in (train.main, tool.main):
        assert main(["--conf", "nope.yml"] if main is train.main else ["--load", "nope", "--prompt", "x"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"but {', '.join(missing)} not" in err and "Traceback" not in err, err
