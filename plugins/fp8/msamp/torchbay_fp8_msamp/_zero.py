"""Reading the ZeRO stage MS-AMP must refuse, from whatever form the config holds it in."""

from __future__ import annotations


def zero_stage(config) -> int | None:
    """The DeepSpeed ZeRO stage of ``config`` when ``strategy: deepspeed``, read defensively.

    Looks at a ``deepspeed`` section with ``zero_stage``/``stage`` or a nested
    ``zero_optimization.stage`` (attributes or mapping keys), and at a DeepSpeed JSON (a
    mapping, a JSON string or a file path) in ``config``/``ds_config``/``deepspeed_config_file``.
    """
    if getattr(config, "strategy", None) != "deepspeed":
        return None
    section = getattr(config, "deepspeed", None)
    if section is None:
        return None

    def get(obj, key):
        if isinstance(obj, dict):
            return obj.get(key)
        return getattr(obj, key, None)

    for key in ("zero_stage", "stage"):
        value = get(section, key)
        if isinstance(value, int):
            return value
    for holder in (section, get(section, "config"), get(section, "ds_config"), get(section, "deepspeed_config_file")):
        if holder is None:
            continue
        if isinstance(holder, str):
            try:
                import json

                holder = json.loads(holder) if holder.strip().startswith("{") else json.load(open(holder))
            except Exception:
                continue
        zero = get(holder, "zero_optimization")
        stage = get(zero, "stage") if zero is not None else None
        if isinstance(stage, int):
            return stage
    return None
