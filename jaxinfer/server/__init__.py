"""`python -m jaxinfer serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).
`serve(llm, config)` wires the package's modules: it starts the engine thread, binds
the socket and runs uvicorn until a signal, then shuts down gracefully. See
docs/serving.md (#shutdown, #multi-host-serving).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from jaxinfer.api import LLM
from jaxinfer.config import ServerConfig
from jaxinfer.engine.parallel.lockstep import Leader, Watchdog
from jaxinfer.engine.request import SamplingParams
from jaxinfer.pooling.engine import PoolingEngine
from jaxinfer.server import adapters, http
from jaxinfer.server.app import ServerState, create_app
from jaxinfer.server.engine_loop import EngineLoop
from jaxinfer.server.pooling_loop import PoolingLoop

log = logging.getLogger(__name__)
SHUTDOWN_MESSAGE = "the server shut down before the request finished"
FORCED_MESSAGE = "the server was stopped (a second signal) before the request finished"
FORCED_GRACE_S = 1.0  # for the aborted streams' last events after a second signal
FAILURE_GRACE_S = 2.0  # multi-host: for the failed requests' error responses, then exit
ENGINE_FAILED_EXIT = 1


def serve(llm: LLM, config: ServerConfig, sock: socket.socket | None = None, *,
          model_name: str, ready: Callable[[str], None] | None = None,
          lockstep: Leader | None = None, step_timeout_s: float | None = None,
          warm_up: bool = False) -> None:
    """Serve `llm` until a signal, on `sock` (from `bind`) or a socket bound to the
    config's host and port; `ready(url)` is called once it listens. `warm_up`: warm the
    engine up once the config's LoRA modules are loaded (a bad one fails before the
    compiles: the CLI makes the LLM without warm-up then). Multi-host, process
    0: `lockstep` wraps `llm.engine` (engine/parallel/lockstep.py), a step running longer than
    `step_timeout_s` fails the engine, and so does a step that raises; either exits the
    process non-zero FAILURE_GRACE_S later. A pooling model gets a PoolingLoop instead
    (docs/pooling.md#serving)."""
    if isinstance(llm.engine, PoolingEngine):
        if lockstep is not None:
            raise ValueError("a pooling model is served by one process, not multi-host")
        loop = PoolingLoop(llm.engine, max_waiting_requests=config.max_waiting_requests)
    else:
        loop = EngineLoop(lockstep or llm.engine,
                          max_waiting_requests=config.max_waiting_requests)
    if lockstep is not None:
        refuse_adapters(config)
        _fail_fatally(loop, lockstep, step_timeout_s)
    state = make_state(llm, config, loop, model_name)
    if warm_up:
        llm.engine.warm_up()
    app = create_app(state)
    sock = sock or bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    server = _Server(uvicorn.Config(
        app, log_config=None, access_log=not config.disable_uvicorn_access_log, lifespan="off",
        log_level=config.uvicorn_log_level,
        http=http.protocol_class(config.header_read_timeout, config.body_read_timeout),
        timeout_graceful_shutdown=config.shutdown_timeout + 5), state)
    loop.start()
    try:
        if ready is not None:
            ready(url)
        server.run(sockets=[sock])
    finally:
        loop.stop()
        sock.close()
        if lockstep is not None and loop.healthy:
            lockstep.close()  # after the drain: the followers return
    log.info("server at %s stopped", url)


def refuse_adapters(config: ServerConfig) -> None:
    """Multi-host: the other processes' engines are not sent adapters."""
    given = "lora_modules" if config.lora_modules else (
        "allow_runtime_lora_updating" if config.allow_runtime_lora_updating else adapters.ENV)
    if config.lora_modules or adapters.runtime_updating(config):
        raise ValueError(f"{given}: a multi-host server serves no LoRA adapters (the other "
                         "processes are not sent them); serve adapters from one host")


def _fail_fatally(loop: EngineLoop, lockstep: Leader, step_timeout_s: float | None) -> None:
    """Multi-host: an engine failure ends the process, non-zero, once the failed requests'
    responses had FAILURE_GRACE_S to go out (a lost process cannot rejoin the job, and
    JAX's shutdown barrier would wait for it); a step that hangs is such a failure."""
    def exit_soon(failure: str) -> None:
        log.error("multi-host engine failed (%s); exiting in %ss", failure, FAILURE_GRACE_S)
        _after(FAILURE_GRACE_S, _exit_now)

    def hung(seconds: float) -> None:
        loop.fail(TimeoutError(
            f"an engine step has run for {seconds:.0f}s, longer than heartbeat_timeout_s="
            f"{step_timeout_s}: a process of the multi-host job is lost or hung"))

    loop.on_failure = exit_soon
    if step_timeout_s is not None:
        lockstep.watchdog = Watchdog(step_timeout_s, hung)


def _exit_now() -> None:
    logging.shutdown()
    sys.stderr.flush()
    os._exit(ENGINE_FAILED_EXIT)


def make_state(llm: LLM, config: ServerConfig, loop: EngineLoop | PoolingLoop,
               model_name: str) -> ServerState:
    """What the routes share, for `llm` served as `model_name` (also the batch runner's
    in-process app, jaxinfer/batch/in_process.py); a pooling model samples nothing. The
    config's LoRA modules are loaded here, before the loop's thread starts (ValueError
    naming lora_modules for a bad one)."""
    tokenizer = llm.tokenizer
    for flag in ("reasoning_parser", "tool_call_parser"):
        if tokenizer is None and getattr(config, flag) is not None:
            raise ValueError(f"--{flag}={getattr(config, flag)} reads the generated text: it "
                             "needs the model's tokenizer (drop --skip_tokenizer_init)")
    token_text = None
    if tokenizer is not None:
        token_text = functools.lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
    pooling = isinstance(llm.engine, PoolingEngine)
    served = adapters.Adapters(enabled=not pooling and llm.engine.config.enable_lora)
    adapters.load_modules(llm.engine, served, config.lora_adapters, model_name)
    return ServerState(loop=loop, config=config, model_name=model_name, adapters=served,
                       model_root=str(llm.engine.model_dir), max_model_len=llm.max_model_len,
                       defaults=SamplingParams() if pooling else llm.engine.default_params,
                       token_text=token_text, tokenizer=tokenizer,
                       enable_prompt_logprobs=llm.engine.config.enable_prompt_logprobs)


def _after(seconds: float, action: Callable[[], None]) -> None:
    timer = threading.Timer(seconds, action)
    timer.daemon = True
    timer.start()


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port), not yet listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server. Its first exit signal stops admission, ends the uploads still
    arriving (503) and arms the deadline after which requests still in flight are
    aborted; a second signal aborts them at once, gives their streams FORCED_GRACE_S to
    send the error event and `[DONE]`, then quits without waiting further."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._event_loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._event_loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        engine_loop, timeout = self._state.loop, self._state.config.shutdown_timeout
        if self.should_exit:  # the second signal: quit now
            log.info("signal %d again: aborting %d request(s)", sig, engine_loop.num_in_flight)
            engine_loop.abort_all(FORCED_MESSAGE)
            _after(FORCED_GRACE_S, lambda: setattr(self, "force_exit", True))
            return
        log.info("signal %d: finishing %d request(s) within %ss", sig,
                 engine_loop.num_in_flight, timeout)
        engine_loop.accepting = False
        if self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(self._state.draining.set)
        _after(timeout, lambda: engine_loop.abort_all(SHUTDOWN_MESSAGE))
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, less its re-raising the signal once the server stopped (which kills
        the process with it: `serve` would never return, nor the CLI exit 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
