"""``torchbay launch [flags] script.py [script args]``: run a script in every process of the job."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = """\
Start your script in every process of the job through torch.distributed.run.

--num-processes is the total across all machines, --nproc-per-node the count on each
machine; give one of them (both only if they multiply out with --num-machines). Inside a
SLURM, MPI or torchrun allocation the allocation decides. Each setting comes from, lowest
first: defaults, --config-file, TORCHBAY_* variables, these flags. The resolved config
reaches every process as one value, so Accelerator() needs no arguments. Everything is
validated before any process starts; when a rank fails, every rank is stopped and the rank
that failed first is named with its traceback.
"""


def register(subparsers) -> None:
    from torchbay.cli.options import CONFIG_DESTS_ATTR, add_config_options

    parser = subparsers.add_parser("launch", help="run a script in N processes (torchrun underneath)",
                                   usage="torchbay launch [options] [-m] TARGET [ARGS ...]",
                                   description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(parser, "launch")
    parser.add_argument("--as-accelerate", dest="launch.as_accelerate", action="store_const", const=True,
                        default=argparse.SUPPRESS,
                        help="the workers answer `import accelerate` with torchbay, so transformers' Trainer, peft, "
                             "trl and diffusers run on it unchanged (config key launch.as_accelerate)")
    getattr(parser, CONFIG_DESTS_ATTR)["launch.as_accelerate"] = "--as-accelerate"
    parser.add_argument("-m", "--module", action="store_true", help="run TARGET as a module (python -m TARGET)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan (each number with its source) and the torchrun command; start nothing")
    parser.add_argument("-q", "--quiet", action="store_true", help="do not print the plan line before starting")
    parser.add_argument("script", metavar="TARGET", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to the script")
    parser.set_defaults(func=launch_command)


def launch_command(args: argparse.Namespace) -> int:
    import os

    from torchbay.cli.options import resolve_from_args
    from torchbay.errors import ConfigError
    from torchbay.launch.plan import check_port_free, prepare
    from torchbay.launch.run import exec_direct, run_torchrun, torchrun_argv
    from torchbay.registry.manager import get_plugin_manager

    args.script_args = script_args_as_given(args)
    if not args.module and os.path.isdir(args.script):
        raise ConfigError(f"script '{args.script}' is a directory, not a Python file; give the script inside it "
                          f"(e.g. {os.path.join(args.script, 'train.py')}) or a module with -m NAME",
                          header="nothing to launch")
    if args.module:
        _check_module(args.script)
    if not args.module and not os.path.isfile(args.script):
        raise ConfigError(f"script '{args.script}' does not exist (to run a module, use torchbay launch -m NAME)",
                          header="nothing to launch")
    pm = get_plugin_manager()
    try:
        resolved = resolve_from_args(args, pm=pm)
    finally:
        _remove_imported_config(args)
    plan, context, env = prepare(resolved, pm)
    check_port_free(plan)
    setup = (f"device {context.device_backend_cls.name}, strategy {context.strategy_cls.name}, "
             f"mixed_precision {resolved.config.mixed_precision}") + \
        _mesh(resolved.config, context.strategy_cls.built_sizes(resolved.config, plan.num_processes))
    if args.dry_run:
        print("\n".join(plan.describe()))
        print(f"set-up: {setup}{_found_config(args)}")
        extra = sorted(k for k in env if k != "TORCHBAY_RESOLVED_CONFIG")
        print("worker environment: TORCHBAY_RESOLVED_CONFIG" + "".join(f", {k}={env[k]}" for k in extra))
        if plan.mode == "torchrun":
            print("torchrun " + " ".join(torchrun_argv(plan, args.script, args.script_args, args.module)))
        return 0
    if not args.quiet:
        print(f"torchbay launch: {plan.summary()}; {setup}{_found_config(args)}", file=sys.stderr, flush=True)
    if plan.mode == "direct":
        exec_direct(plan, env, args.script, args.script_args, args.module)
    code = run_torchrun(plan, env, args.script, args.script_args, args.module)
    if _is_console_command():
        _exit_now(code)
    return code


def _remove_imported_config(args: argparse.Namespace) -> None:
    """The temporary torchbay config imported from an Accelerate ``--config_file`` has been read: remove it (that
    file only, which torchbay wrote; the workers get the resolved config)."""
    from torchbay.compat.accelerate_config_file import remove_imported_config

    remove_imported_config(getattr(args, "_imported_config", None))
    args._imported_config = None


def _found_config(args: argparse.Namespace) -> str:
    if not getattr(args, "config_file_found", False):
        return ""
    return f"; config file ./{args.config_file} (found in the working directory; --config-file FILE to use another)"


def _check_module(name: str) -> None:
    """``-m NAME``: the module must be importable from here, as the workers will import it."""
    import importlib.util
    import os

    from torchbay.errors import ConfigError

    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    if not found:
        raise ConfigError(f"module '{name}' (given with -m) cannot be imported from {os.getcwd()}; check its name, "
                          f"install it, or run from the folder that holds it", header="nothing to launch")


def script_args_as_given(args: argparse.Namespace) -> list[str]:
    """The arguments after the script exactly as typed (argparse drops a ``--`` among them)."""
    argv = getattr(args, "_argv", None)
    if argv is None:
        return list(args.script_args)
    for i, token in enumerate(argv):
        if token != args.script:
            continue
        rest = argv[i + 1:]
        stripped = list(rest)
        if "--" in stripped:
            stripped.remove("--")
        if rest == list(args.script_args) or stripped == list(args.script_args):
            return rest
    return list(args.script_args)


def _is_console_command() -> bool:
    """Whether this process is the ``torchbay`` command itself (not a caller of ``main()``)."""
    import os

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) == "torchbay.cli.main" or \
        os.path.basename(getattr(main, "__file__", "") or "") == "torchbay"


def _exit_now(code: int) -> None:
    """End the launcher once every worker is gone, skipping the interpreter's teardown of
    torch's modules (seconds, with nothing left to clean up; on a multi-machine job torchrun's
    exit barrier has already been passed)."""
    import logging

    from torchbay.launch.worker import fast_exit

    fast_exit(code, logging.shutdown)


def _mesh(config, sizes: dict[str, int]) -> str:
    """``, mesh pp 2 x dp_shard 2 (pp schedule 1F1B)`` for the sizes > 1 the strategy builds, else nothing."""
    from torchbay.distributed.parallelism_config import parallel_sizes

    if all(size == 1 for size in parallel_sizes(config).values()):
        return ""  # no parallelism asked for: the strategy's default layout, not worth a line
    mesh = " x ".join(f"{dim} {size}" for dim, size in sizes.items() if size > 1)
    schedule = getattr(getattr(config, "parallelism", None), "pp_schedule", None)
    return (f", mesh {mesh}" + (f" (pp schedule {schedule})" if sizes.get("pp", 1) > 1 and schedule else "")
            if mesh else "")
