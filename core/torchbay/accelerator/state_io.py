"""``save_state`` / ``load_state`` and what joins them: ``register_for_checkpointing`` and Accelerate's save-state
and load-state pre-hooks (diffusers' training scripts save and load their models through them).

Mixin of :class:`~torchbay.accelerator.accelerator.Accelerator`; the work is the checkpointer's
(:mod:`torchbay.checkpoint.checkpointer`, hooks: :mod:`torchbay.checkpoint.save_hooks`).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from torch.utils.hooks import RemovableHandle

from torchbay.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from torchbay.axes.strategy import Strategy
    from torchbay.checkpoint.checkpointer import StateCheckpointer


def refuse_unsupported(method: str, what: Any, why: str) -> None:
    """Raise for an Accelerate argument torchbay does not honour, rather than ignore it."""
    if what:
        raise ConfigError(f"{method}({what}) is not supported: {why}; remove the argument")


class StateSaving:
    """Mixin: the checkpoint methods of the Accelerator."""

    # what they read from the Accelerator: the checkpointer and the prepared objects (checkpointed.py)
    strategy: Strategy
    _checkpointer: StateCheckpointer
    _models: list[Any]
    _custom_objects: list[Any]

    def _hooks(self, kind: str) -> OrderedDict:
        return self.__dict__.setdefault(f"_{kind}_model_state_pre_hook", OrderedDict())  # Accelerate's names

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (each with ``state_dict()`` and ``load_state_dict()``) with the state."""
        bad = [f"Item at index {i}, `{type(o).__name__}`" for i, o in enumerate(objects)
               if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if bad:
            raise ConfigError(bad, header="register_for_checkpointing takes objects with state_dict() and "
                                          "load_state_dict(); these have not (register the object holding them)")
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` in every ``save_state``, on every process, before anything
        is written: ``models`` the prepared models, ``weights`` their state dicts, ``output_dir`` the directory
        being written (``<output_dir>.partial``, published as ``output_dir`` with the files the hook wrote there).
        A model whose entry the hook removes from ``weights`` (on the main process) is not saved by torchbay."""
        handle = RemovableHandle(self._hooks("save"))
        self._hooks("save")[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` in every ``load_state`` before anything is restored; the models the
        hook removes from ``models`` (those it loads itself) are not restored by torchbay."""
        handle = RemovableHandle(self._hooks("load"))
        self._hooks("load")[handle.id] = hook
        return handle

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, *,
                   blocking: bool | None = None, **save_model_func_kwargs: Any) -> Any:
        """Save everything prepared (and registered) to ``output_dir``, atomically; see
        docs/checkpoint-guarantees.md. Model weights go through ``checkpoint.io``, or with
        ``safe_serialization=False`` into torch's pickle files (``model_<i>.bin``, read back weights-only).

        ``blocking=False``: the state at the call is copied and written in the background; returns
        an :class:`~torchbay.checkpoint.async_save.AsyncSave` (``wait()``, ``done()``). Unset, it is
        ``True`` except for automatic checkpoints with ``checkpoint.async_save: true``. A pickle save, or one
        with save-state pre-hooks, is written before ``save_state`` returns."""
        refuse_unsupported("save_state", save_model_func_kwargs and ", ".join(save_model_func_kwargs),
                           "torchbay does not pass arguments to a save function; set checkpoint.* instead")
        checkpointer = self._checkpointer
        hooks = list(self._hooks("save").values())
        before_write = None
        if hooks:
            def before_write(directory: Path) -> list[int] | None:
                from torchbay.checkpoint.save_hooks import kept_after_hooks

                weights = [self.strategy.model_state_dict(m) for m in self._models]
                return kept_after_hooks(hooks, self._models, weights, directory)
        if safe_serialization:
            saved = checkpointer.save(output_dir, blocking, before_write=before_write)
        else:
            from torchbay.checkpoint.io_choice import PICKLE_IO

            checkpointer.finish_pending()  # a background save in flight writes with the run's io
            with checkpointer.using_io(checkpointer.io_named(PICKLE_IO)):
                saved = checkpointer.save(output_dir, blocking, before_write)
        return saved if not isinstance(saved, Path) else str(saved)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> str:
        """Restore what :meth:`save_state` wrote (verified first; nothing changes on a bad checkpoint)."""
        refuse_unsupported("load_state", load_kwargs and "load_kwargs",
                           "torchbay loads optimizer state with weights_only=True and maps it itself")
        refuse_unsupported("load_state", load_model_func_kwargs and ", ".join(load_model_func_kwargs),
                           "models are loaded strictly; a checkpoint that does not fit is an error")
        checkpointer = self._checkpointer
        hooks = list(self._hooks("load").values())
        if not hooks:
            return str(checkpointer.load(input_dir))
        checkpointer.finish_pending()
        directory = checkpointer.main_only("load_state", lambda: checkpointer.target_for_load(input_dir))
        models = list(self._models)
        for hook in hooks:
            hook(models, str(directory))
        kept = [i for i, m in enumerate(self._models) if any(m is k for k in models)]
        with checkpointer.only_models(None if len(kept) == len(self._models) else kept):
            return str(checkpointer.load(str(directory)))
