"""How the engine is served: `DistributedConfig` (joining a multi-host job) and
`ServerConfig` (the OpenAI-compatible server). The CLI derives one flag per field, as
for EngineConfig; docs/serving.md.
"""

from __future__ import annotations

import dataclasses
import json

from jaxinfer.config.engine import setting

# `--reasoning_parser` values (vLLM's names): the keys of jaxinfer.text.reasoning.PARSERS,
# listed here because config sits below the text layer
REASONING_PARSERS = ("openai_gptoss", "qwen3")
# `--tool_call_parser` values (vLLM's names): the keys of jaxinfer.text.tool_parsers.PARSERS
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "openai")
# `--uvicorn_log_level` values (vLLM's, uvicorn's)
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
LORA_MODULE_KEYS = ("name", "path", "base_model_name")  # vLLM's JSON form of a module


@dataclasses.dataclass(frozen=True)
class LoraModule:
    """An adapter served at start (`--lora_modules`): clients select it by `name`."""

    name: str
    path: str
    base_model_name: str | None = None  # /v1/models' `parent`; default: the served model


def parse_lora_module(text: str) -> LoraModule:
    """vLLM's two spellings of a module: `name=path`, or a JSON object with `name`,
    `path` and optionally `base_model_name`; ValueError naming lora_modules."""
    if not isinstance(text, str):
        raise ValueError(f"lora_modules: {text!r} must be a string, name=path")
    if not text.lstrip().startswith("{"):
        name, equals, path = text.partition("=")
        if not equals or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules={text!r} must be name=path or a JSON object "
                             f"with {', '.join(LORA_MODULE_KEYS)}")
        return LoraModule(name.strip(), path.strip())
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_modules={text!r} is not JSON: {e}") from None
    unknown = sorted(set(data) - set(LORA_MODULE_KEYS)) if isinstance(data, dict) else []
    if unknown:
        raise ValueError(f"lora_modules={text!r}: unknown key(s) {unknown}; a module has "
                         f"{', '.join(LORA_MODULE_KEYS)}")
    for key in ("name", "path"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ValueError(f"lora_modules={text!r}: {key!r} must be a non-empty string")
    base = data.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"lora_modules={text!r}: 'base_model_name' must be a string")
    return LoraModule(data["name"], data["path"], base)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How this process joins a multi-host job (jaxinfer/distributed.py): the three
    addressing fields all given, or `detect_distributed` (JAX finds them), or neither (one
    process, nothing initialized). The CLI derives one flag per field, as for EngineConfig."""

    coordinator_address: str | None = setting(
        None, "multi-host: host:port of process 0's coordinator, the same on every process")
    num_processes: int | None = setting(None, "multi-host: processes in the job, one per "
                                         "host")
    process_id: int | None = setting(None, "multi-host: this process's index, 0 to "
                                      "num_processes - 1; process 0 writes the outputs")
    detect_distributed: bool = setting(
        False, "multi-host, addresses found by JAX: Cloud TPU VM slices (GCE, GKE), Slurm, "
        "Open MPI")
    initialization_timeout_s: int = setting(
        300, "multi-host: seconds to wait for every process to join before failing")
    heartbeat_timeout_s: int = setting(
        100, "multi-host: seconds without a heartbeat after which a process counts as dead "
        "and the job stops with an error")

    def __post_init__(self) -> None:
        given = [name for name in ("coordinator_address", "num_processes", "process_id")
                 if getattr(self, name) is not None]
        if given and len(given) < 3:
            raise ValueError(f"{given[0]}={getattr(self, given[0])!r}: give all of "
                             "coordinator_address, num_processes and process_id, or none")
        if given and self.detect_distributed:
            raise ValueError(f"{self.detect_distributed=}: give it or coordinator_address, "
                             "num_processes and process_id, not both")
        for name in ("num_processes", "initialization_timeout_s", "heartbeat_timeout_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive int")
        if given and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"{self.process_id=} must be in [0, {self.num_processes=})")
        host, _, port = (self.coordinator_address or "h:1").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{self.coordinator_address=} must be host:port")

    @property
    def enabled(self) -> bool:
        """Whether this process joins a multi-host job."""
        return self.detect_distributed or self.coordinator_address is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """How `python -m jaxinfer serve` listens and protects itself (jaxinfer/server/). The
    CLI derives one flag per field, as for EngineConfig."""

    host: str = setting("127.0.0.1", "address to listen on; 0.0.0.0 exposes the server to "
                         "the network (set --api_key then)")
    port: int = setting(8000, "TCP port; 0 picks a free one (logged)")
    api_key: str | None = setting(None, "clients must send 'Authorization: Bearer KEY' to "
                                   "/v1/*; default: no key")
    served_model_name: str | None = setting(None, "the model name clients give; default: "
                                             "--model as given ('demo' for the bundled one)")
    max_waiting_requests: int = setting(
        256, "completions waiting for a slot (n counts each); over it requests get 503 with "
        "Retry-After")
    max_request_body_bytes: int = setting(
        8 * 2**20, "larger request bodies get 413 (a larger Content-Length at once, before "
        "the body is read)")
    header_read_timeout: float = setting(
        10.0, "seconds a connection has to send a request's headers, from its first byte "
        "(or from connecting); then 408 and the connection is closed")
    body_read_timeout: float = setting(
        60.0, "seconds a request has to send its whole body after its headers; then 408 "
        "and the connection is closed")
    shutdown_timeout: int = setting(
        30, "seconds after SIGTERM to finish in-flight requests; then they are aborted with "
        "an error and the process exits 0")
    reasoning_parser: str | None = setting(
        None, "chat: split a reasoning model's output, its reasoning into the message's "
        "`reasoning` field and its answer into `content` (vLLM's flag and field); "
        "openai_gptoss: gpt-oss's harmony channels (analysis and commentary: reasoning, "
        "final: content); qwen3: <think>...</think> is reasoning (Qwen3, and the output may "
        "start inside the block when the chat template opens it)", REASONING_PARSERS)
    include_reasoning_content: bool = setting(
        False, "with --reasoning_parser, also send the reasoning as `reasoning_content` "
        "(DeepSeek's and SGLang's name, and vLLM's before `reasoning`) for clients that "
        "read only that")
    disable_uvicorn_access_log: bool = setting(
        False, "no access log (vLLM's flag); by default each request is logged as uvicorn "
        "logs it: '127.0.0.1:PORT - \"POST /v1/chat/completions HTTP/1.1\" 200'")
    uvicorn_log_level: str | None = setting(
        None, "the level of uvicorn's own logs, its access log included (vLLM's flag; "
        "warning: no access log); default: as the rest of the logging (--verbosity)",
        UVICORN_LOG_LEVELS)
    enable_auto_tool_choice: bool = setting(
        False, "chat: let the model decide to call tools (tool_choice 'auto', OpenAI's "
        "default when tools are given); needs --tool_call_parser. Without it such a "
        "request is a 400 naming tool_choice (vLLM's flag and rule)")
    tool_call_parser: str | None = setting(
        None, "chat: the format a model writes tool calls in, read into `tool_calls` "
        "(vLLM's names): hermes (Hermes, Qwen2.5, Qwen3: <tool_call>{json}</tool_call>), "
        "llama3_json (Llama 3.1-3.3 JSON calls), mistral ([TOOL_CALLS]...), openai "
        "(gpt-oss: harmony's commentary to=functions.NAME)", TOOL_CALL_PARSERS)
    server_dev_mode: bool = setting(
        False, "serve the routes that change the model's state, for RL rollouts (vLLM's "
        "VLLM_SERVER_DEV_MODE=1): /sleep, /wake_up, /is_sleeping, /reset_prefix_cache, "
        "/pause, /resume, /is_paused and SGLang's /update_weights_from_disk, /flush_cache, "
        "/release_memory_occupation, /resume_memory_occupation; under --api_key")
    lora_modules: tuple[str, ...] = setting(
        (), "LoRA adapters served from the start (vLLM's --lora-modules; needs "
        "--enable_lora): name=path, or vLLM's JSON {\"name\": ..., \"path\": ..., "
        "\"base_model_name\": ...}; repeat the flag or list several after it. A request "
        "selects one by its `model`; /v1/models lists them")
    allow_runtime_lora_updating: bool = setting(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load "
        "and unload adapters while the server runs (also turned on by vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); under --api_key")
    responses_store_max_entries: int = setting(
        1024, "/v1/responses: responses kept for GET /v1/responses/{id} and "
        "previous_response_id; past it the least recently used go (then a 404)")
    responses_store_max_bytes: int = setting(
        256 * 2**20, "/v1/responses: the kept responses' size in all (JSON bytes, each with "
        "its conversation); past it the least recently used go")
    responses_store_ttl_s: int = setting(
        3600, "/v1/responses: seconds a response is kept after it was made")

    def __post_init__(self) -> None:
        self._check_lora_modules()
        for name in ("max_waiting_requests", "max_request_body_bytes", "shutdown_timeout",
                     "responses_store_max_entries", "responses_store_max_bytes",
                     "responses_store_ttl_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive int")
        for name in ("header_read_timeout", "body_read_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"{name}={value!r} must be a positive number of seconds")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port!r} must be in [0, 65536)")
        if self.api_key == "":
            raise ValueError("api_key must not be empty (leave it unset for no key)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} must be one of "
                             f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} must be one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.uvicorn_log_level not in (None, *UVICORN_LOG_LEVELS):
            raise ValueError(f"uvicorn_log_level={self.uvicorn_log_level!r} must be one of "
                             f"{', '.join(UVICORN_LOG_LEVELS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice=True needs tool_call_parser (which "
                             "format the model writes its calls in)")
        if self.include_reasoning_content and self.reasoning_parser is None:
            raise ValueError("include_reasoning_content=True needs reasoning_parser (there "
                             "is no reasoning to send without one)")

    @property
    def lora_adapters(self) -> tuple[LoraModule, ...]:
        """`lora_modules` read (checked when the config was made)."""
        return tuple(map(parse_lora_module, self.lora_modules))

    def _check_lora_modules(self) -> None:
        modules = self.lora_modules
        if isinstance(modules, str) or not isinstance(modules, list | tuple):
            raise ValueError(f"lora_modules={modules!r} must be a list of name=path strings")
        object.__setattr__(self, "lora_modules", tuple(modules))  # hashable, as every config
        names = [module.name for module in self.lora_adapters]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"lora_modules: the name {repeated[0]!r} is given twice")
