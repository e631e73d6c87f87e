"""The LoRA adapters a server serves by name (vLLM's serving models): `Adapters`, the
registry the handlers read on the event loop's thread, and what changes the engine's
adapters, run before the engine thread starts (`--lora_modules`) or on it (loads,
unloads, a request's adapter read again after its host copy was dropped). The routes
are lora_routes.py's. See docs/lora.md#serving-adapters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from jaxinfer.config.serving import LoraModule, ServerConfig
from jaxinfer.lora.request import LoRARequest
from jaxinfer.server.protocol import APIError

ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's switch for the load and unload routes
_TRUE = ("1", "true")  # the values vLLM reads as on


def runtime_updating(config: ServerConfig) -> bool:
    """Whether the load and unload routes are served: --allow_runtime_lora_updating, or
    vLLM's environment variable."""
    return config.allow_runtime_lora_updating or \
        os.environ.get(ENV, "").strip().lower() in _TRUE


class Adapters:
    """The adapters served, by name, in the order they were loaded; their ids are the
    server's own, counting up from 1 (an id is never reused: the engine keys its slots
    and cached pages by it). Used on the event loop's thread only."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled  # the engine was started with enable_lora
        self._by_name: dict[str, LoRARequest] = {}
        self._busy: set[str] = set()  # names a load or unload is under way for
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def loaded(self) -> list[LoRARequest]:
        return list(self._by_name.values())

    def new(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """An adapter under the next id, not yet served (`put` serves it)."""
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def put(self, lora: LoRARequest) -> None:
        self._by_name.pop(lora.lora_name, None)  # a replaced one: listed last, as loaded
        self._by_name[lora.lora_name] = lora

    def drop(self, name: str) -> None:
        self._by_name.pop(name, None)

    @contextlib.contextmanager
    def changing(self, name: str) -> Iterator[None]:
        """Hold `name` while a load or unload of it runs; a second one meanwhile is a 409."""
        if name in self._busy:
            raise APIError(409, f"lora_name: the adapter {name!r} is being loaded or "
                           "unloaded by another request; retry once it is done",
                           param="lora_name", code="adapter_busy")
        self._busy.add(name)
        try:
            yield
        finally:
            self._busy.discard(name)


def load_modules(engine: Any, adapters: Adapters, modules: Sequence[LoraModule],
                 model_name: str) -> None:
    """Load `--lora_modules` into `engine` before its thread starts; ValueError naming
    the flag and the module."""
    if modules and not adapters.enabled:
        raise ValueError("lora_modules needs enable_lora=True (--enable_lora): this engine "
                         "serves no LoRA adapters")
    for module in modules:
        if module.name == model_name:
            raise ValueError(f"lora_modules: {module.name!r} is the served model's own name; "
                             "give the adapter another")
        lora = adapters.new(module.name, module.path, module.base_model_name)
        try:
            add_everywhere(engine, lora)
        except (ValueError, TypeError) as e:
            raise ValueError(f"lora_modules: {module.name}={module.path}: {e}") from None
        adapters.put(lora)


# ---- on the engine thread ------------------------------------------------------------

def _engines(engine: Any) -> list[Any]:
    """The engines holding adapters: each data-parallel replica, or the one engine."""
    return list(getattr(engine, "replicas", None) or [engine])


def add_everywhere(engine: Any, lora: LoRARequest) -> None:
    """Read `lora` into every engine, in place of any adapter of its name there (a bad
    adapter raises ValueError and is added nowhere)."""
    added = []
    try:
        for one in _engines(engine):
            _forget_name(one, lora.lora_name)
            one.add_lora(lora)
            added.append(one)
    except Exception:
        for one in added:
            one.remove_lora(lora.lora_int_id)
        raise


def remove_everywhere(engine: Any, lora: LoRARequest) -> None:
    """Forget `lora` in every engine; requests running with it finish with it."""
    for one in _engines(engine):
        one.remove_lora(lora.lora_int_id)


def _forget_name(engine: Any, name: str) -> None:
    """Drop the engine's host copy of an adapter under `name`: the one a load in place
    replaces, or one the server no longer serves (a request prepared with it as it was
    unloaded reads it back); the engine refuses a second adapter under a name."""
    slots = engine.adapter_slots
    for held in slots.loaded() if slots is not None else []:
        if held.lora_name == name:
            engine.remove_lora(held.lora_int_id)


def attach(engine: Any, request: Any, lora: LoRARequest | None) -> Any:
    """`request` (a PreparedRequest) to run with `lora`, its host copy read again if the
    engine dropped it; a 400 naming `model` when it cannot be."""
    if lora is None:
        return request
    try:
        for one in _engines(engine):
            one.adapter_of(lora)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"model: the adapter {lora.lora_name!r} cannot be read: {e}",
                       param="model", code="adapter_unreadable") from None
    return dataclasses.replace(request, lora=lora)
