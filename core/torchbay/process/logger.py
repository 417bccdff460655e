"""Accelerate's logger (``accelerate.logging``): a ``logging.LoggerAdapter`` that logs on the main process only, or on
every process in process order, served by :mod:`torchbay` and :mod:`torchbay.utils` as ``get_logger``."""

from __future__ import annotations

import logging
import os


def _is_main(local: bool) -> bool:
    return int(os.environ.get("LOCAL_RANK" if local else "RANK", "0")) == 0


class MultiProcessAdapter(logging.LoggerAdapter):
    """Logs on the main process only, unless ``main_process_only=False``; ``in_order=True`` logs
    every process's message in process order (a collective: call it on every process)."""

    def log(self, level, msg, *args, main_process_only: bool = True, in_order: bool = False, **kwargs):
        if not self.isEnabledFor(level):
            return
        # the record names the caller of logger.info(...), not this method (logging skips its own frames)
        kwargs.setdefault("stacklevel", 2)
        if not main_process_only and in_order:
            from torchbay.process.current import current  # (the run, started on first use as PartialState() would)

            run = current()
            for index in range(run.num_processes):
                if index == run.process_index:
                    m, kw = self.process(msg, dict(kwargs))
                    self.logger.log(level, m, *args, **kw)
                    for handler in self.logger.handlers + logging.getLogger().handlers:
                        handler.flush()
                run.strategy.barrier()
            return
        if not main_process_only or _is_main(local=False):
            msg, kwargs = self.process(msg, kwargs)
            self.logger.log(level, msg, *args, **kwargs)

    def warning_once(self, *args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        seen = self.__dict__.setdefault("_warned", set())
        if key not in seen:
            seen.add(key)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """The logger ``name`` wrapped in a :class:`MultiProcessAdapter`; ``log_level`` (or ``TORCHBAY_LOG_LEVEL``) sets
    its level and the root logger's."""
    logger = logging.getLogger(name)
    level = log_level or os.environ.get("TORCHBAY_LOG_LEVEL")
    if level:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})
