"""Write docs/hooks.md from torchbay.hookspecs (run: python docs/generate_hooks.py)."""

import inspect
import os
import sys

from torchbay import hookspecs


def hook_names():
    return [n for n, f in inspect.getmembers(hookspecs, inspect.isfunction) if n.startswith("torchbay_")]


def render() -> str:
    lines = ["# Hook reference", "", "Generated from `core/torchbay/hookspecs.py` by `docs/generate_hooks.py`; "
             "do not edit by hand.", "", inspect.getdoc(hookspecs), ""]
    source = inspect.getsource(hookspecs)
    for name in sorted(hook_names(), key=source.index):
        func = getattr(hookspecs, name)
        opts = getattr(func, "torchbay_spec", {}) or {}
        flags = [k for k in ("historic", "firstresult") if opts.get(k)]
        lines += [f"## {name}", "", f"```python\n{name}{inspect.signature(func)}\n```", ""]
        if flags:
            lines += [f"*{', '.join(flags)}*", ""]
        lines += [inspect.getdoc(func) or "", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(__file__), "hooks.md")
    with open(out, "w") as f:
        f.write(render())
    print(f"wrote {out}", file=sys.stderr)
