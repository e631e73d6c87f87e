"""vLLM's routes that load and unload LoRA adapters while the server runs (POST
/v1/load_lora_adapter and /v1/unload_lora_adapter, its bodies and answers), served only
with --allow_runtime_lora_updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, under
--api_key; and the adapters' entries in /v1/models. The engine is changed on its own
thread (EngineLoop.call). See docs/lora.md#serving-adapters.
"""

from __future__ import annotations

import os
from typing import Any

import fastapi
from fastapi.responses import PlainTextResponse, Response

from jaxinfer.server.adapters import Adapters, add_everywhere, remove_everywhere
from jaxinfer.server.protocol import APIError, Body
from jaxinfer.server.state import ServerState, parsed

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
OFF = ("is served only with --allow_runtime_lora_updating (or vLLM's "
       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")


class LoadAdapterRequest(Body):
    """vLLM's body: the adapter's name (what requests give as `model`) and directory."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter already served under the name


class UnloadAdapterRequest(Body):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; when given, the adapter's id (checked)


async def load_lora_adapter(request: fastapi.Request) -> Response:
    """200 with vLLM's text once every engine holds the adapter; 400 naming the field
    (a name in use or the served model's, an adapter the engine refuses: a bad
    adapter_config.json, a rank over max_lora_rank, ...), 404 for a directory that is not
    there. A failed load in place leaves the adapter served before."""
    state, body = await parsed(request, LoadAdapterRequest)
    adapters, name = state.adapters, body.lora_name
    _check_loadable(state, body)
    if not os.path.isdir(body.lora_path):
        raise APIError(404, f"lora_path: no adapter directory at {body.lora_path!r}",
                       param="lora_path", code="adapter_not_found")
    with adapters.changing(name):
        lora = adapters.new(name, body.lora_path)
        try:
            await state.loop.call(lambda engine: add_everywhere(engine, lora))
        except (ValueError, TypeError) as e:
            raise APIError(400, f"lora_path: the adapter cannot be loaded: {e}",
                           param="lora_path", code="invalid_adapter") from None
        adapters.put(lora)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


def _check_loadable(state: ServerState, body: LoadAdapterRequest) -> None:
    name = body.lora_name
    if not state.adapters.enabled:
        raise APIError(400, "this server serves no LoRA adapters: start it with "
                       "--enable_lora", code="lora_disabled")
    for field in ("lora_name", "lora_path"):
        if not getattr(body, field).strip():
            raise APIError(400, f"{field} must not be empty", param=field)
    if name == state.model_name:
        raise APIError(400, f"lora_name: {name!r} is the served model's own name; give the "
                       "adapter another", param="lora_name")
    if state.adapters.get(name) is not None and not body.load_inplace:
        raise APIError(400, f"lora_name: the adapter {name!r} has already been loaded; "
                       "unload it first, or give load_inplace: true to replace it",
                       param="lora_name", code="adapter_exists")


async def unload_lora_adapter(request: fastapi.Request) -> Response:
    """200 with vLLM's text; 404 for a name not served. Requests running with the
    adapter finish with it; later ones naming it get the unknown model's 404."""
    state, body = await parsed(request, UnloadAdapterRequest)
    adapters, name = state.adapters, body.lora_name
    lora = adapters.get(name)
    if lora is None:
        served = ", ".join(repr(lora.lora_name) for lora in adapters.loaded()) or "none"
        raise APIError(404, f"lora_name: the adapter {name!r} is not loaded (loaded: "
                       f"{served})", param="lora_name", code="adapter_not_found")
    if body.lora_int_id is not None and body.lora_int_id != lora.lora_int_id:
        raise APIError(400, f"lora_int_id={body.lora_int_id}: the adapter {name!r} has id "
                       f"{lora.lora_int_id}", param="lora_int_id")
    with adapters.changing(name):
        adapters.drop(name)  # first: no request starts with it from now on
        await state.loop.call(lambda engine: remove_everywhere(engine, lora))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def install(app: fastapi.FastAPI) -> None:
    app.add_api_route(LOAD, load_lora_adapter, methods=["POST"])
    app.add_api_route(UNLOAD, unload_lora_adapter, methods=["POST"])


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models' entries (vLLM's shape): the served model, then each adapter with its
    directory as `root` and the base model as `parent`."""
    adapters: Adapters = state.adapters
    base = {"id": state.model_name, "object": "model", "created": state.started,
            "owned_by": "jaxinfer", "root": state.model_root, "parent": None,
            "max_model_len": state.max_model_len}
    return [base, *({**base, "id": lora.lora_name, "root": lora.lora_path,
                     "parent": lora.base_model_name or state.model_name}
                    for lora in adapters.loaded())]


def off_hint(path: str) -> str:
    """For the 404 of a load or unload route not served: how to serve it."""
    return f" ({path} {OFF})" if path in (LOAD, UNLOAD) else ""
