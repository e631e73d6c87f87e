"""`python -m jaxinfer serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

ARCHITECTURE.md plans one `server.py`; the face is a package because it has five
separate concerns that each fill a module: the request bodies and errors
(`protocol`), the thread that owns the engine (`engine_loop`), response shapes
(`responses`), the routes (`app`) and the Prometheus exposition (`prometheus`).
This module wires them: `serve(llm, config)` starts the engine thread, binds the
socket, runs uvicorn until SIGTERM/SIGINT, then shuts down gracefully: new
requests get 503, requests in flight have `shutdown_timeout` seconds to finish,
then are aborted with an error, and `serve` returns (the CLI exits 0). Imports
the server modules, api (for LLM) and config; sits between cli and api.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from jaxinfer.api import LLM
from jaxinfer.config import ServerConfig
from jaxinfer.server.app import ServerState, create_app
from jaxinfer.server.engine_loop import EngineLoop

log = logging.getLogger(__name__)
SHUTDOWN_MESSAGE = "the server shut down before the request finished"


def serve(llm: LLM, config: ServerConfig, sock: socket.socket | None = None, *,
          model_name: str, ready: Callable[[str], None] | None = None) -> None:
    """Serve `llm` until a signal, on `sock` (from `bind`) or a socket bound to the
    config's host and port; `ready(url)` is called once it listens."""
    loop = EngineLoop(llm.engine, max_waiting_requests=config.max_waiting_requests)
    app = create_app(_state(llm, config, loop, model_name))
    sock = sock or bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}"
    server = _Server(uvicorn.Config(
        app, log_config=None, access_log=False, lifespan="off",
        timeout_graceful_shutdown=config.shutdown_timeout + 5), loop, config.shutdown_timeout)
    loop.start()
    try:
        if ready is not None:
            ready(url)
        server.run(sockets=[sock])
    finally:
        loop.stop()
        sock.close()
    log.info("server at %s stopped", url)


def _state(llm: LLM, config: ServerConfig, loop: EngineLoop, model_name: str) -> ServerState:
    tokenizer = llm.tokenizer
    token_text = None
    if tokenizer is not None:
        token_text = functools.lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
    return ServerState(loop=loop, config=config, model_name=model_name,
                       model_root=str(llm.engine.model_dir), max_model_len=llm.max_model_len,
                       defaults=llm.engine.default_params, token_text=token_text,
                       enable_prompt_logprobs=llm.engine.config.enable_prompt_logprobs)


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
    """uvicorn's server, whose first exit signal also stops admission and arms the
    deadline after which requests still in flight are aborted."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, timeout: float) -> None:
        super().__init__(config)
        self._engine_loop = loop
        self._timeout = timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("signal %d: finishing %d request(s) within %ss", sig,
                     self._engine_loop.num_in_flight, self._timeout)
            self._engine_loop.accepting = False
            timer = threading.Timer(self._timeout, self._engine_loop.abort_all,
                                    args=(SHUTDOWN_MESSAGE,))
            timer.daemon = True
            timer.start()
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
