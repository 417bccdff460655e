"""One process of a compatibility run: import an Accelerate test script and run its cases.

``python worker.py SCRIPT OUT_DIR [CASE ...]`` (``COMPAT_RUN_MAIN=1``: the whole script instead
of cases). Unless ``COMPAT_ON_ACCELERATE=1``, every ``accelerate`` import is redirected to torchbay
first. Each rank appends
``{"case", "event": "start"|"end", "ok", "error"}`` lines to ``OUT_DIR/rank<N>.jsonl`` as it
goes, so a run that hangs still tells which case hung. A case (or a whole script) that runs
longer than ``COMPAT_CASE_LIMIT_S`` seconds writes every thread's stack to
``OUT_DIR/rank<N>.stack`` and ends its process: the launch then stops at once (torchbay launch
ends the other ranks) and the runner shows where the rank was stuck.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import json
import os
import sys
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cases as _cases  # noqa: E402
import redirect  # noqa: E402


class _Inert(types.ModuleType):
    """Stands in for a third-party module a script imports only for cases it cannot run here."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _InertObject(f"{self.__name__}.{name}")


class _InertObject:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, name):
        return _InertObject(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        return None


def first_error_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    message = f"{type(exc).__name__}: {text[0] if text else ''}".strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        message += f" [{os.path.basename(last.filename)}:{last.lineno}]"
    return message[:400]


#: longer than any case takes on a loaded 2-core machine (seconds, not minutes), and longer than
#: the runner's 120 s process-group timeout, so a rank stuck in a collective fails by itself first
CASE_LIMIT_S = float(os.environ.get("COMPAT_CASE_LIMIT_S", "180"))


def main(argv: list[str]) -> int:
    script_name, out_dir, *case_names = argv
    # modes come by environment: a launcher never mistakes them for its own options
    use_accelerate = os.environ.get("COMPAT_ON_ACCELERATE") == "1"
    run_main = os.environ.get("COMPAT_RUN_MAIN") == "1"
    script = _cases.SCRIPTS[script_name]
    if not use_accelerate:
        redirect.install()
    # inert stand-ins only while the script is imported: its own globals keep them, while
    # find_spec() still says the library is missing (so neither side uses it)
    stand_ins = [name for name in script.stand_ins if importlib.util.find_spec(name) is None]
    for name in stand_ins:
        sys.modules[name] = _Inert(name)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"rank{rank}.jsonl", "a", buffering=1)

    def record(**fields):
        log.write(json.dumps(fields) + "\n")

    stacks = open(out / f"rank{rank}.stack", "w")

    module_name = "accelerate.test_utils.scripts." + script.path[:-3].replace("/", ".")
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # the import itself is a result: every case fails with it
        traceback.print_exc()
        record(case="<import>", event="end", ok=False, error=first_error_line(exc))
        return 1
    finally:
        for name in stand_ins:
            sys.modules.pop(name, None)
    if run_main:  # the whole script: its main(), or its ``if __name__ == "__main__"`` block
        faulthandler.dump_traceback_later(2 * CASE_LIMIT_S, exit=True, file=stacks)
        if hasattr(module, "main"):
            module.main()
        else:
            import runpy

            runpy.run_path(module.__file__, run_name="__main__")
        return 0
    namespace = module.__dict__
    try:
        if script.setup:
            exec(script.setup, namespace)
    except BaseException as exc:
        traceback.print_exc()
        record(case="<setup>", event="end", ok=False, error=first_error_line(exc))
        return 1
    codes = dict(script.cases)
    failed = 0
    for name in case_names:
        record(case=name, event="start")
        faulthandler.dump_traceback_later(CASE_LIMIT_S, exit=True, file=stacks)
        try:
            exec(codes[name], namespace)
        except BaseException as exc:
            failed += 1
            print(f"--- case {name} failed on rank {rank}", file=sys.stderr)
            traceback.print_exc()
            record(case=name, event="end", ok=False, error=first_error_line(exc))
        else:
            record(case=name, event="end", ok=True, error="")
        finally:
            faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
