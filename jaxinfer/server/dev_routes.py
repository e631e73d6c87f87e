"""The routes that change the served model's state, for RL rollouts beside a trainer:
vLLM's (/sleep, /wake_up, /is_sleeping, /reset_prefix_cache, /pause, /resume,
/is_paused) and SGLang's (/update_weights_from_disk, /flush_cache,
/release_memory_occupation, /resume_memory_occupation, /pause_generation,
/continue_generation). Served only with --server_dev_mode, under --api_key; each runs
on the engine thread between steps. See docs/rl.md#the-server.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fastapi
from fastapi.responses import JSONResponse, Response

from jaxinfer.server.protocol import APIError, Body
from jaxinfer.server.state import authorized, parsed

# What a pause or update does to requests in flight, over HTTP: vLLM's "wait" finishes
# them first, which the engine thread cannot do while streams wait on it
POLICIES = ("abort", "keep")


class UpdateFromDiskRequest(Body):
    """SGLang's /update_weights_from_disk body (`load_format` accepted as "auto")."""

    model: str | None = None  # the served model's name, when given (checked)
    model_path: str
    load_format: str | None = None
    policy: str = "abort"  # requests in flight: abort or keep (docs/rl.md)


async def _on_engine(request: fastapi.Request, fn: Callable[[Any], Any]) -> Any:
    """`fn(engine)` on the engine thread; its ValueError or RuntimeError is a 400 with the
    engine's message (a request in flight, a bad level, weights that do not match)."""
    state = authorized(request)
    try:
        return await state.loop.call(fn)
    except (ValueError, RuntimeError, NotImplementedError) as e:
        raise APIError(400, str(e), code="invalid_state") from None


def _level(request: fastapi.Request) -> int:
    value = request.query_params.get("level", "1")
    if value not in ("1", "2"):
        raise APIError(400, f"level={value!r} must be 1 or 2", param="level")
    return int(value)


async def sleep(request: fastapi.Request) -> Response:
    level = _level(request)
    await _on_engine(request, lambda engine: engine.sleep(level))
    return Response(status_code=200)


async def wake_up(request: fastapi.Request) -> Response:
    tags = request.query_params.getlist("tags") or None
    await _on_engine(request, lambda engine: engine.wake_up(tags))
    return Response(status_code=200)


async def is_sleeping(request: fastapi.Request) -> Response:
    asleep = await _on_engine(request, lambda engine: engine.is_sleeping())
    return JSONResponse({"is_sleeping": asleep})


async def reset_prefix_cache(request: fastapi.Request) -> Response:
    await _on_engine(request, lambda engine: engine.reset_prefix_cache())
    return Response(status_code=200)


def _policy(value: str, name: str) -> str:
    if value not in POLICIES:
        raise APIError(400, f"{name}={value!r} must be one of {', '.join(POLICIES)} (over "
                       "HTTP; 'wait' is the Python API's)", param=name)
    return value


async def pause(request: fastapi.Request) -> Response:
    mode = _policy(request.query_params.get("mode", "abort"), "mode")
    aborted = await _on_engine(request, lambda engine: engine.pause_generation(mode))
    return JSONResponse({"success": True, "aborted": aborted})


async def resume(request: fastapi.Request) -> Response:
    await _on_engine(request, lambda engine: engine.resume_generation())
    return Response(status_code=200)


async def is_paused(request: fastapi.Request) -> Response:
    paused = await _on_engine(request, lambda engine: engine.paused)
    return JSONResponse({"is_paused": paused})


async def update_weights_from_disk(request: fastapi.Request) -> Response:
    """SGLang's shape: {"success": bool, "message": str}; a mismatch is a 400 naming it."""
    _, body = await parsed(request, UpdateFromDiskRequest)
    _policy(body.policy, "policy")
    if body.load_format not in (None, "auto"):
        raise APIError(400, f"load_format={body.load_format!r}: only 'auto' (the "
                       "directory's own files)", param="load_format")
    await _on_engine(request, lambda engine: engine.update_weights(body.model_path,
                                                                   policy=body.policy))
    return JSONResponse({"success": True, "message": f"weights updated from "
                                                     f"{body.model_path}"})


async def release_memory_occupation(request: fastapi.Request) -> Response:
    """SGLang's: the weights to host memory and the KV cache freed (vLLM's level 1)."""
    await _on_engine(request, lambda engine: engine.sleep(1))
    return JSONResponse({"success": True})


async def resume_memory_occupation(request: fastapi.Request) -> Response:
    await _on_engine(request, lambda engine: engine.wake_up(None))
    return JSONResponse({"success": True})


async def flush_cache(request: fastapi.Request) -> Response:
    await _on_engine(request, lambda engine: engine.reset_prefix_cache())
    return JSONResponse({"success": True})


ROUTES: dict[str, tuple[str, Callable]] = {
    "/sleep": ("POST", sleep), "/wake_up": ("POST", wake_up),
    "/is_sleeping": ("GET", is_sleeping), "/reset_prefix_cache": ("POST", reset_prefix_cache),
    "/pause": ("POST", pause), "/resume": ("POST", resume), "/is_paused": ("GET", is_paused),
    "/update_weights_from_disk": ("POST", update_weights_from_disk),
    "/release_memory_occupation": ("POST", release_memory_occupation),
    "/resume_memory_occupation": ("POST", resume_memory_occupation),
    "/flush_cache": ("POST", flush_cache), "/pause_generation": ("POST", pause),
    "/continue_generation": ("POST", resume),
}


def install(app: fastapi.FastAPI) -> None:
    for path, (method, handler) in ROUTES.items():
        app.add_api_route(path, handler, methods=[method])
