"""Progress bars that suit where they are shown.

On a terminal (or in a notebook) a bar is ``tqdm.auto.tqdm`` unchanged. When its stream is not a
terminal - a CI log, a SLURM output file, ``nohup`` - a redrawn bar would put ~10 carriage-return
updates a second into the file, so it prints a few plain lines instead: the start, one line each time
the bar passes another tenth of its total or every ``LINE_INTERVAL_S`` seconds, and the end.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any

LINE_INTERVAL_S = 30.0
LINE_FRACTION_STEP = 0.1
#: the bars made by :func:`progress_bar` that are still alive: telemetry shows tokens/s (or samples/s) on them
LIVE_BARS: weakref.WeakSet = weakref.WeakSet()


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any):
    """``tqdm.auto.tqdm``, disabled on every process but the local main one by default; when stderr
    is not a terminal (a log file), a few plain lines instead of a redrawn bar (Accelerate's ``tqdm``)."""
    if args and isinstance(args[0], bool):  # Accelerate's old tqdm(main_process_only, iterable)
        main_process_only, args = args[0], args[1:]
    return progress_bar(*args, main_process_only=main_process_only, **kwargs)


def progress_bar(*args: Any, main_process_only: bool = True, **kwargs: Any):
    """A tqdm bar, disabled on every process but the local main one by default."""
    if main_process_only:
        local_main = int(os.environ.get("LOCAL_RANK", "0")) == 0
        kwargs["disable"] = kwargs.get("disable", False) or not local_main
    bar = _bar_class(kwargs.get("file"))(*args, **kwargs)
    if not bar.disable:
        LIVE_BARS.add(bar)
    return bar


def _bar_class(stream: Any):
    from tqdm.auto import tqdm as auto_tqdm
    from tqdm.autonotebook import tqdm as terminal_or_notebook
    from tqdm.std import tqdm as terminal_tqdm

    in_notebook = terminal_or_notebook is not terminal_tqdm
    if in_notebook or _is_terminal(stream if stream is not None else sys.stderr):
        return auto_tqdm
    return _log_lines_class()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


_LOG_LINES_CLASS = None


def _log_lines_class():
    global _LOG_LINES_CLASS
    if _LOG_LINES_CLASS is None:
        from tqdm.auto import tqdm as auto_tqdm

        class LogLinesTqdm(auto_tqdm):
            """tqdm that writes whole lines, a few per run, for streams that are not terminals."""

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._last_line_t: float | None = None
                self._last_line_step = -1
                self._last_line_n: float | None = None
                super().__init__(*args, **kwargs)

            def display(self, msg: str | None = None, pos: int | None = None) -> bool:
                if msg == "" or (pos or 0) != 0:  # clearing or a nested bar's position: not for a log
                    return False
                if not self._line_due():
                    return False
                self._write_line(msg)
                return True

            def close(self) -> None:
                if self.disable:
                    return
                shown = getattr(self, "last_print_t", 0) >= self.start_t + self.delay
                if shown and self._last_line_n != self.n:  # a log cannot erase: even leave=False ends with a line
                    self._ema_dt = lambda: None  # the end line shows the overall rate
                    self._write_line(None)
                self.leave = False  # nothing to clear: tqdm's close then writes no carriage return
                super().close()

            def _step(self) -> int:
                if not self.total:
                    return 0
                return int(min(self.n / self.total, 1.0) / LINE_FRACTION_STEP + 1e-9)

            def _line_due(self) -> bool:
                if self._last_line_t is None:
                    return True
                if self._step() > self._last_line_step:
                    return True
                return self._time() - self._last_line_t >= LINE_INTERVAL_S

            def _write_line(self, msg: str | None) -> None:
                line = self.__str__() if msg is None else msg
                self.fp.write(line.rstrip() + "\n")
                getattr(self.fp, "flush", lambda: None)()
                self._last_line_t = self._time()
                self._last_line_step = self._step()
                self._last_line_n = self.n

        _LOG_LINES_CLASS = LogLinesTqdm
    return _LOG_LINES_CLASS
