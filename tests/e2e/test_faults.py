"""Faults end to end: preemption by SIGTERM and Ctrl-C, auto-resume after torchrun restarts, a dead and a hung rank.

The command lines of a test run at the same time: each start-up (~6 s of torch imports) overlaps the others."""
from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from megatron_sp import checkpointing

from .runs import BASE, DROPOUT, ROOT, metrics, train

DP2 = ["parallel.dp=2"]
DP2_DROPOUT = [*DP2, *DROPOUT]  # the resumed ranks draw the uninterrupted run's masks: bitwise with dropout
STEPS = 20


def _start(run_dir: Path, data: str, *overrides: str, torchrun: list[str] | None = None) -> subprocess.Popen:
    prefix = [sys.executable, *(["-m", "torch.distributed.run", *torchrun] if torchrun else []), "train.py"]
    args = [*prefix, *BASE, f"data.paths=[{data}]", f"logging.dir={run_dir}/log",
            f"data.cache_dir={Path(data).parent}/cache", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env,  # SIGINT as in a terminal, even if pytest ignores it
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _when_logged(*plans: tuple[subprocess.Popen, Path, int, Callable[[], object]], timeout: float = 120) -> None:
    """For each (process, run_dir, n, action): ``action()`` as soon as that run has logged ``n`` steps. The runs of a
    test start together (their start-ups overlap) and each acts on its own step count."""
    pending = list(plans)
    deadline = time.monotonic() + timeout
    while pending:
        for plan in list(pending):
            proc, run_dir, n, action = plan
            path = run_dir / "log" / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) >= n:
                action()
                pending.remove(plan)
            else:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"steps not logged in {timeout} s: {[str(p[1]) for p in pending]}"
        time.sleep(0.05)


def _rank_pid(run_dir: Path, rank: int) -> int:
    """The pid of the worker process of ``rank`` of the run logging into ``run_dir``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and str(run_dir).encode() in cmd and b"LOCAL_RANK" in b"".join(env):
            return int(entry)
    raise AssertionError(f"no worker of rank {rank} found")


def _same_trajectory(got: dict, ref: dict, steps: range) -> None:
    assert sorted(got) == list(steps), sorted(got)
    for s in steps:  # same layout: bitwise
        assert got[s]["loss"] == ref[s]["loss"] and got[s]["grad_norm"] == ref[s]["grad_norm"], s


def test_sigterm_saves_then_auto_resume_and_torchrun_restarts_continue(tmp_path, byte_data):
    # Two command lines at once: SIGTERM to train.py (the local launcher passes it on) after step 3; and torchrun
    # --max-restarts 1 whose rank 1 is killed after a checkpoint (step 5), so that the restarted ranks auto-resume.
    pre, res = tmp_path / "preempted", tmp_path / "restarted"
    preempted = _start(pre, byte_data, "train.iters=400", f"checkpoint.save={pre}/ckpt", *DP2_DROPOUT)
    restarted = _start(res, byte_data, f"train.iters={STEPS}", f"checkpoint.save={res}/ckpt", "checkpoint.interval=2",
                       "checkpoint.auto_resume=true", *DP2_DROPOUT,
                       torchrun=["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval",
                                 "0.1"])
    _when_logged((preempted, pre, 3, lambda: preempted.send_signal(signal.SIGTERM)),
                 (restarted, res, 5, lambda: os.kill(_rank_pid(res, 1), signal.SIGKILL)))
    reference = tmp_path / "reference"  # the uninterrupted run, while they save, stop and restart
    train(reference, byte_data, f"train.iters={STEPS}", *DP2_DROPOUT)
    ref = metrics(reference)

    # SIGTERM: every rank saves the same step, exit 0
    out, err = preempted.communicate(timeout=120)
    assert preempted.returncode == 0, err[-3000:]
    ckpt = checkpointing.resolve(pre / "ckpt")
    k = checkpointing.read_meta(ckpt)["step"]
    assert 3 <= k < STEPS - 2 and "SIGTERM: saving a checkpoint" in out
    # auto_resume picks checkpoint.save's latest and continues on the uninterrupted trajectory (while torchrun restarts)
    train(pre, byte_data, f"train.iters={STEPS}", f"checkpoint.save={pre}/ckpt", "checkpoint.auto_resume=true", *DP2_DROPOUT)
    _same_trajectory(metrics(pre), ref, range(1, STEPS + 1))
    meta = checkpointing.read_meta(checkpointing.resolve(pre / "ckpt"))  # the resumed run continues the lineage
    assert [start for _, start in meta["lineage"]] == [0, k] and meta["lineage"][-1][0] == meta["run_id"]

    # torchrun restarted the ranks, which auto-resumed
    out, err = restarted.communicate(timeout=300)
    assert restarted.returncode == 0, err[-3000:]
    assert "checkpoint.auto_resume: resuming from" in out
    _same_trajectory(metrics(res), ref, range(1, STEPS + 1))


def test_ctrl_c_saves_the_agreed_step_then_exits_130(tmp_path, byte_data):
    """The first SIGINT is a preemption: a 1-rank train.py, and 2 ranks through train.py's launcher (torchrun
    passes SIGINT on to them), save the step they agree on and exit 130."""
    runs = {1: tmp_path / "one", 2: tmp_path / "two"}
    procs = {n: _start(d, byte_data, "train.iters=400", f"checkpoint.save={d}/ckpt", *(DP2 if n == 2 else []))
             for n, d in runs.items()}
    _when_logged(*((proc, runs[n], 3, functools.partial(proc.send_signal, signal.SIGINT)) for n, proc in procs.items()))
    for n, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err[-3000:]
        k = checkpointing.read_meta(checkpointing.resolve(runs[n] / "ckpt"))["step"]
        assert k >= 3 and f"SIGINT: saving a checkpoint at step {k}, then exiting" in out
        assert f"interrupted: saved a checkpoint of step {k}" in err.splitlines() and "Traceback" not in err
        assert max(metrics(runs[n])) == k
    assert "stopped by SIGINT; the ranks saved" in out
    # train.py's launcher keeps each rank's output in logging.dir/ranks (and shows it unprefixed, as asserted above)
    logs = {f.parent.name: f.read_text() for f in (runs[2] / "log" / "ranks").glob("*/attempt_0/*/stdout.log")}
    assert sorted(logs) == ["0", "1"] and f"SIGINT: saving a checkpoint at step {k}, then exiting" in logs["0"]
    assert f"interrupted: saved a checkpoint of step {k}" in next((runs[2] / "log" / "ranks").glob("*/*/0/stderr.log")).read_text()


def test_dead_and_hung_ranks_end_the_run_with_one_line_naming_them(tmp_path, byte_data):
    """Two runs at once: rank 1 of one is killed (SIGKILL), rank 1 of the other stopped (SIGSTOP: hung)."""
    dead, hung = tmp_path / "dead", tmp_path / "hung"
    procs = {d: _start(d, byte_data, "train.iters=400", "parallel.timeout_s=5", *DP2) for d in (dead, hung)}
    _when_logged(*((proc, d, 2, lambda: None) for d, proc in procs.items()))
    pids = {d: _rank_pid(d, 1) for d in procs}
    t = time.monotonic()
    os.kill(pids[hung], signal.SIGSTOP)
    os.kill(pids[dead], signal.SIGKILL)
    try:
        # SIGKILL: the launcher sees the death and stops the others at once
        _, err = procs[dead].communicate(timeout=60)
        assert procs[dead].returncode != 0 and time.monotonic() - t < 5
        last = err.strip().splitlines()[-1]  # with the planner's estimate when train.preflight is on
        assert last.startswith("error: rank 1 of 2 was killed by signal SIGKILL, probably out of memory (") \
            and last.endswith("); the other ranks were stopped"), last
        assert "Traceback" not in err

        # SIGSTOP (hung): rank 0's collective times out after parallel.timeout_s and names rank 1
        line = ""
        while "stopped answering" not in line:
            line = procs[hung].stderr.readline()
            assert line, "stderr closed without naming the hung rank"
        assert time.monotonic() - t < 5 + 5 + 5  # timeout + listening for survivors + slack
        assert line.startswith("error: [rank 0] a collective failed: rank 1 stopped answering (dead or hung)")
    finally:
        os.kill(pids[hung], signal.SIGKILL)  # the launcher would wait 30 s before killing a stopped process
        procs[hung].communicate(timeout=60)
    assert procs[hung].returncode != 0
