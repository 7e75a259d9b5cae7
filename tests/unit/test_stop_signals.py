"""Stop signals while the main thread is inside one long torch op (faults.Preemption, launcher.start_local): the
first is acknowledged at once, a second stops at once (exit 130), in a rank and through train.py's local launcher.
Each test starts real processes; the op (one conv1d, ~1 min on one core) outlasts every assertion window."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

AT_ONCE_S = 3.0  # what "at once" means here (the op takes far longer), generous for a loaded 2-core machine

# One rank: Preemption watching, told it computes step 5 of ~35 s steps, then one conv1d that holds the main thread
# in C++ (float64, 1 thread); run plainly it starts 2 ranks of itself with launcher.start_local.
SCRIPT = '''
import os, sys, torch
from pathlib import Path
from megatron_sp import faults, launcher, metrics
mode, save_dir = sys.argv[1], sys.argv[2] or None
if mode == "launch" and not launcher.under_torchrun():
    metrics.setup_logging("info", 0)
    sys.exit(launcher.start_local(2, sys.argv[1:], Path(sys.argv[3]), save_dir, cpu=True))
if launcher.under_torchrun():
    torch.distributed.init_process_group("gloo")
metrics.setup_logging("info", int(os.environ.get("RANK", "0")))
torch.set_num_threads(1)
p = faults.Preemption(enabled=mode != "nosave", save_dir=save_dir)
p.step_started(5, 35.0)
x, w = torch.randn(1, 1, 100_000, dtype=torch.float64), torch.randn(1, 1, 50_000, dtype=torch.float64)
print("busy", flush=True)
torch.nn.functional.conv1d(x, w)
print("op ended", flush=True)
'''


class _Proc:
    """A process whose stdout and stderr lines are collected, each with its arrival time, as they come."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        script = tmp_path / "long_op.py"
        script.write_text(SCRIPT)
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"},
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.readers = [threading.Thread(target=self._read, args=(s,), daemon=True)
                        for s in (self.proc.stdout, self.proc.stderr)]
        for t in self.readers:
            t.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, needle: str, timeout: float) -> float:
        """Seconds from now until a line containing ``needle`` has come (fails after ``timeout``)."""
        start = time.monotonic()
        while not any(needle in line for _, line in self.lines):
            assert self.proc.poll() is None or time.monotonic() - start < 1, f"exited {self.proc.poll()}:\n{self.text()}"
            assert time.monotonic() - start < timeout, f"no line with {needle!r} in {timeout} s:\n{self.text()}"
            time.sleep(0.02)
        return time.monotonic() - start

    def signal_and_wait_exit(self, sig: int) -> float:
        start = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=60)
        finally:
            self.kill()
        for t in self.readers:
            t.join(timeout=10)
        return time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def test_first_ctrl_c_says_what_happens_at_once_and_a_second_exits_at_once(tmp_path):
    p = _Proc(tmp_path, "save", str(tmp_path / "ckpt"))
    try:
        p.wait_for("busy", timeout=120)
        time.sleep(0.3)  # inside the op
        p.proc.send_signal(signal.SIGINT)
        assert p.wait_for("SIGINT: saving a checkpoint at the end of step 5 (steps take ~35 s), then exiting; "
                          "Ctrl-C again to stop at once without saving", timeout=30) < AT_ONCE_S
        assert p.signal_and_wait_exit(signal.SIGINT) < AT_ONCE_S
    finally:
        p.kill()
    assert p.proc.returncode == 130, p.text()
    assert "interrupted: stopped at once in step 5 without saving (SIGINT then SIGINT)" in p.text()
    assert "op ended" not in p.text()


def test_sigterm_twice_waits_for_the_step_then_ctrl_c_exits_at_once_keeping_the_last_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000004").mkdir(parents=True)
    (ckpt / "latest").write_text("iter_0000004\n")
    p = _Proc(tmp_path, "save", str(ckpt))
    try:
        p.wait_for("busy", timeout=120)
        time.sleep(0.3)
        p.proc.send_signal(signal.SIGTERM)
        assert p.wait_for("SIGTERM: saving a checkpoint at the end of step 5 (steps take ~35 s), then exiting; "
                          "Ctrl-C (SIGINT) to stop at once without saving", timeout=30) < AT_ONCE_S
        p.proc.send_signal(signal.SIGTERM)  # a scheduler and torchrun may both send one: changes nothing
        time.sleep(1.0)
        assert p.proc.poll() is None, p.text()
        assert p.signal_and_wait_exit(signal.SIGINT) < AT_ONCE_S
    finally:
        p.kill()
    assert p.proc.returncode == 130, p.text()
    assert f"(SIGTERM then SIGINT); the last checkpoint, {ckpt / 'iter_0000004'}, stays" in p.text()


def test_without_checkpoint_save_ctrl_c_exits_at_once(tmp_path):
    p = _Proc(tmp_path, "nosave", "")
    try:
        p.wait_for("busy", timeout=120)
        time.sleep(0.3)
        assert p.signal_and_wait_exit(signal.SIGINT) < AT_ONCE_S
    finally:
        p.kill()
    assert p.proc.returncode == 130, p.text()
    assert "interrupted: stopped at once in step 5 without saving (no checkpoint.save, nothing to save)" in p.text()


def test_local_launcher_relays_sigterm_then_ctrl_c_at_once_and_tees_rank_logs(tmp_path):
    """train.py's launcher (torchrun in-process): SIGTERM reaches the ranks (rank 0 says it saves at the end of the
    step); Ctrl-C then stops every rank at once, though torchrun alone would send SIGTERM again (no effect)."""
    ckpt, logs = tmp_path / "ckpt", tmp_path / "ranks"
    p = _Proc(tmp_path, "launch", str(ckpt), str(logs))
    try:
        deadline = time.monotonic() + 180
        while sum(line == "busy" for _, line in p.lines) < 2:  # both ranks inside the op
            assert p.proc.poll() is None and time.monotonic() < deadline, p.text()
            time.sleep(0.05)
        time.sleep(0.3)
        p.proc.send_signal(signal.SIGTERM)
        assert p.wait_for("SIGTERM: saving a checkpoint at the end of step 5", timeout=30) < AT_ONCE_S
        time.sleep(0.5)
        assert p.proc.poll() is None, p.text()
        assert p.signal_and_wait_exit(signal.SIGINT) < AT_ONCE_S
    finally:
        p.kill()
    out = p.text()
    assert p.proc.returncode == 130, out
    assert out.count("SIGTERM: saving a checkpoint") == 1 and "[default" not in out  # rank 0 only, no tee prefixes
    assert out.splitlines()[-1] == "interrupted: the ranks were stopped at once without saving", out
    assert "op ended" not in out and "Traceback" not in out
    files = {f.relative_to(f.parents[2]).as_posix(): f.read_text() for f in logs.glob("*/attempt_0/*/*.log")}
    assert sorted(files) == ["attempt_0/0/stderr.log", "attempt_0/0/stdout.log", "attempt_0/1/stderr.log",
                             "attempt_0/1/stdout.log"], files
    assert "SIGTERM: saving a checkpoint" in files["attempt_0/0/stdout.log"] and "busy" in files["attempt_0/1/stdout.log"]


def test_agreed_and_finish_in_process():
    """The flag the watcher thread sets, agreed on after the step (the identity at one rank); SIGINT ends in
    KeyboardInterrupt (exit 130) after the save, SIGTERM returns (exit 0)."""
    import torch

    from megatron_sp import faults

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a foreground process
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            p = faults.Preemption(enabled=True)
            assert not p.agreed(torch.device("cpu"))
            os.kill(os.getpid(), sig)
            deadline = time.monotonic() + 10
            while not p.requested:  # set by the watcher thread
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert p.agreed(torch.device("cpu")) and p.signal_name == sig.name
            if sig == signal.SIGTERM:
                p.finish(7)  # returns: exit code 0
            else:
                with pytest.raises(KeyboardInterrupt, match="saved a checkpoint of step 7"):
                    p.finish(7)  # exit code 130 in train.py
    finally:
        faults.watch_stop_signals(None)
        for s, handler in saved.items():
            signal.signal(s, handler)
