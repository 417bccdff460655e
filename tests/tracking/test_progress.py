"""Progress bars: a redrawn bar on a terminal, a few whole lines in a log (issue 28, item 5)."""

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

from torchbay.tracking.progress import LINE_INTERVAL_S, progress_bar

LOOP = """
import time
from torchbay.utils import tqdm
for _ in tqdm(range(200), desc="work"):
    time.sleep(0.005)
"""


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK")}
    env.update(extra)
    return env


def test_a_log_gets_a_few_whole_lines_and_the_end():
    done = subprocess.run([sys.executable, "-c", LOOP], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                          env=_env(), timeout=120, check=True)
    log = done.stderr.decode()
    assert "\r" not in log
    lines = log.splitlines()
    assert 2 <= len(lines) <= 12, log  # the start, each tenth at most, the end
    assert lines[0].startswith("work:   0%")
    assert "200/200" in lines[-1] and lines[-1].startswith("work: 100%")


def test_a_terminal_still_gets_the_redrawn_bar():
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0x0
    try:
        proc = subprocess.Popen([sys.executable, "-c", LOOP], stderr=follower, stdout=subprocess.DEVNULL,
                                env=_env())
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the pty closes when the child exits
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=120) == 0
    finally:
        os.close(leader)
    shown = b"".join(chunks).decode()
    assert shown.count("\r") > 3, shown  # tqdm's own redrawing, unchanged
    assert "200/200" in shown


def test_a_line_every_interval_when_progress_is_slow(monkeypatch):
    log = io.StringIO()
    bar = progress_bar(total=1000, desc="slow", file=log, mininterval=0)
    clock = [bar.start_t]
    monkeypatch.setattr(bar, "_time", lambda: clock[0])
    bar.update(1)  # within the first tenth and no time passed: no line
    assert len(log.getvalue().splitlines()) == 1
    clock[0] += LINE_INTERVAL_S + 1
    bar.update(1)  # still the first tenth, but the interval passed: a line
    assert len(log.getvalue().splitlines()) == 2
    bar.update(498)  # half way: a line at once
    clock[0] += 1
    bar.update(1)  # no new tenth, no interval: none
    bar.close()  # the end
    lines = log.getvalue().splitlines()
    assert len(lines) == 4 and "501/1000" in lines[-1], lines
    assert "\r" not in log.getvalue()


def test_other_local_ranks_show_nothing():
    done = subprocess.run([sys.executable, "-c", LOOP], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                          env=_env(LOCAL_RANK="1"), timeout=120, check=True)
    assert done.stderr.decode() == ""


def test_a_bar_that_would_be_erased_still_ends_its_log_with_the_end():
    log = io.StringIO()
    bar = progress_bar(total=3, desc="x", file=log, leave=False)
    bar.update(3)
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "3/3" in lines[-1] and "\r" not in log.getvalue()  # nothing cleared
