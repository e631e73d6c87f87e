"""The commands that load the weights: generate, batch, serve and eval_ppl run an LLM made
from the engine flags; convert copies an HF checkpoint to an orbax one. Each reads
FLAGS and imports its library only when it runs. See docs/cli.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import signal
import sys
import typing

from absl import app

from jaxinfer.cli import report
from jaxinfer.cli.flags import (
    DISTRIBUTED_FLAGS,
    FLAGS,
    RAY_FLAGS,
    SERVER_FLAGS,
    check_sampling_flags,
    engine_config,
    from_flags,
    make_llm,
    sampling_params,
)
from jaxinfer.config import DEFAULT_MODEL, ServerConfig

GENERATE_DEFAULTS = {"max_num_seqs": 1}  # over the flags; one prompt: fewer buckets
EVAL_PPL_DEFAULTS = {"enable_prompt_logprobs": True}


def generate() -> None:
    from jaxinfer import distributed

    if not FLAGS.prompt:
        raise app.UsageError("--prompt is empty")
    check_sampling_flags()
    # The prompt is checked before warm-up: a bad one fails now, not after compiling.
    llm = make_llm(**GENERATE_DEFAULTS, warm_up=False)
    llm.engine.prompt_token_ids(FLAGS.prompt)
    params = sampling_params(llm.engine.default_params)
    distributed.check_same("the prompt and sampling parameters", repr((FLAGS.prompt, params)))
    if not FLAGS.enforce_eager:
        llm.engine.warm_up()
    (out,) = llm.generate(FLAGS.prompt, params, use_tqdm=False)
    if not distributed.is_primary():  # multi-host: only process 0 prints
        return
    sys.stdout.write(FLAGS.prompt + out.text + "\n")
    logging.info("%d prompt tokens, %d generated, finish_reason=%s, %s",
                 len(out.prompt_token_ids), len(out.token_ids), out.finish_reason, params)
    if FLAGS.metrics:
        sys.stderr.write(json.dumps(llm.metrics()) + "\n")


def batch() -> None:
    from jaxinfer import batch as batch_lib
    from jaxinfer import distributed

    if not FLAGS.input or not FLAGS.output:
        raise app.UsageError("batch needs --input=IN.jsonl and --output=OUT.jsonl")
    modules = _lora_modules(from_flags(ServerConfig, lora_modules=FLAGS.lora_modules))
    if FLAGS.ray and modules:
        raise app.UsageError("--lora_modules is not taken with --ray: its replicas serve "
                             "the base model only")
    if FLAGS.ray:
        return _batch_on_ray()
    given = [name for name in RAY_FLAGS if FLAGS[name].present]
    if given:
        raise app.UsageError(f"--{given[0]} needs --ray")
    engine_config()  # engine flags refused before the files are looked at
    # Bad paths and duplicate ids fail now, not after the model loaded and warmed up.
    primary = distributed.is_primary()
    batch_lib.check_paths(FLAGS.input, FLAGS.output if primary else None,
                          input_name="--input", output_name="--output")
    batch_lib.read_requests(FLAGS.input)
    summary = batch_lib.run(make_llm(), FLAGS.input, FLAGS.output,
                            retry_errors=FLAGS.retry_errors, lora_modules=modules,
                            model_name=FLAGS.model or DEFAULT_MODEL.name)  # as serve's
    if primary:
        report.write(summary, sys.stderr, FLAGS.format, title="batch summary")
    if batch_lib.exit_code(summary):  # 3: lines that failed (docs/cli.md#exit-codes)
        sys.exit(batch_lib.exit_code(summary))


def _batch_on_ray() -> None:
    """batch --ray: this process reads and writes the files; Ray actors run the engines."""
    from jaxinfer import batch as batch_lib

    joined = [name for name in DISTRIBUTED_FLAGS if FLAGS[name].present]
    if joined:
        raise app.UsageError(f"--ray cannot be combined with --{joined[0]}: each Ray "
                             "replica is its own engine, while the multi-host flags join "
                             "one engine over several processes")
    if FLAGS.enforce_eager:
        raise app.UsageError("--enforce_eager is not taken with --ray: each replica warms up")
    try:
        from jaxinfer import ray as ray_batch
    except ImportError as e:
        raise app.UsageError(str(e)) from None
    if FLAGS.num_replicas < 1:
        raise app.UsageError(f"--num_replicas={FLAGS.num_replicas} must be >= 1")
    if FLAGS.ray_batch_size is not None and FLAGS.ray_batch_size < 1:
        raise app.UsageError(f"--ray_batch_size={FLAGS.ray_batch_size} must be >= 1")
    settings = dataclasses.asdict(engine_config())
    kwargs = {} if FLAGS.model is None else {"model": FLAGS.model}
    summary = ray_batch.run_ray(
        FLAGS.input, FLAGS.output, num_replicas=FLAGS.num_replicas,
        ray_address=FLAGS.ray_address, batch_size=FLAGS.ray_batch_size,
        retry_errors=FLAGS.retry_errors, **kwargs, **settings)
    report.write(summary, sys.stderr, FLAGS.format, title="batch summary")
    if batch_lib.exit_code(summary):
        sys.exit(batch_lib.exit_code(summary))


def convert() -> None:
    from jaxinfer import checkpoint

    if not FLAGS.model or not FLAGS.output:
        raise app.UsageError("convert needs --model=HF_DIR and --output=ORBAX_DIR")
    _check_convert_flags()
    from jaxinfer.checkpoint import hub

    # a model that is not there, or a download that fails, is a runtime error (exit 1)
    model = hub.resolve(FLAGS.model, revision=FLAGS.revision, download_dir=FLAGS.download_dir)
    checkpoint.convert_hf_to_orbax(model, FLAGS.output, _convert_dtype(model),
                                   FLAGS.quantization, FLAGS.calibration_data)
    sys.stdout.write(f"wrote {FLAGS.output}\n")


def _check_convert_flags() -> None:
    """--quantization and --calibration_data as the converter takes them, refused before
    the model is read (exit 2)."""
    from jaxinfer.model import quantization

    try:
        quantization.check_mode(FLAGS.quantization)
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None
    if FLAGS.calibration_data is not None and FLAGS.quantization != "int4":
        raise app.UsageError(f"--calibration_data needs --quantization=int4, not "
                             f"{FLAGS.quantization!r}")


def _convert_dtype(model: pathlib.Path) -> str:
    """--dtype for convert: auto keeps the checkpoint's own dtype (float16 as bfloat16),
    which is what the engine serves it in on CPU (config.served_dtype)."""
    from jaxinfer.config import served_dtype

    config = model / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else None
    try:
        return served_dtype(FLAGS.dtype, hf, "cpu")
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None


def eval_ppl() -> None:
    from jaxinfer import evaluate

    if not FLAGS.input:
        raise app.UsageError("eval_ppl needs --input=FILE[,FILE...] (paths or globs)")
    if FLAGS.window is not None and FLAGS.window < 2:  # the most: the model's length - 1
        raise app.UsageError(f"--window={FLAGS.window} must be >= 2")
    if FLAGS.max_tokens_per_file is not None and FLAGS.max_tokens_per_file < 1:
        raise app.UsageError(f"--max_tokens_per_file={FLAGS.max_tokens_per_file} must be "
                             ">= 1")
    files = evaluate.expand_inputs(FLAGS.input)  # bad inputs fail before warm-up
    llm = make_llm(**EVAL_PPL_DEFAULTS, warm_up=False)
    evaluate.resolve_window(llm, FLAGS.window)
    if not FLAGS.enforce_eager:
        llm.engine.warm_up()
    report = evaluate.perplexity(llm, files, window=FLAGS.window,
                                 max_tokens_per_file=FLAGS.max_tokens_per_file)
    sys.stdout.write(json.dumps(report) + "\n")


WARM = "serve: every process warmed up"  # the barrier a multi-host server starts after


def serve() -> None:
    """Serve over HTTP. Multi-host (the distributed flags): process 0 serves, the other
    processes follow its engine step by step (jaxinfer/engine/parallel/lockstep.py)."""
    from jaxinfer import distributed, server
    from jaxinfer.engine.parallel import lockstep

    config = from_flags(ServerConfig, **{name: FLAGS[name].value for name in SERVER_FLAGS})
    engine_config()  # engine flags refused before the port is taken
    _lora_modules(config)
    multihost = distributed.process_count() > 1
    if multihost:
        try:
            lockstep.check_lockstep(engine_config())
        except ValueError as e:
            raise app.UsageError(f"--{e}") from None
        try:
            server.refuse_adapters(config)
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    if multihost and not distributed.is_primary():
        return _follow()
    sock = server.bind(config.host, config.port)  # a taken port fails before warm-up
    adapters_first = bool(config.lora_modules)  # a bad adapter fails before warm-up
    llm = make_llm(warm_up=not adapters_first)
    if multihost:  # ready only once the followers have compiled too (their first step
        distributed.barrier(WARM)  # would otherwise run into the step timeout)
    name = config.served_model_name or FLAGS.model or DEFAULT_MODEL.name

    def ready(url: str) -> None:
        sys.stderr.write(f"jaxinfer: serving {name!r} at {url}/v1\n")
        sys.stderr.flush()

    leader = None
    if multihost:
        from jaxinfer.engine.parallel.channel import KeyValueChannel

        leader = lockstep.Leader(llm.engine, KeyValueChannel())
    server.serve(llm, config, sock, model_name=name, ready=ready, lockstep=leader,
                 step_timeout_s=FLAGS.heartbeat_timeout_s if multihost else None,
                 warm_up=adapters_first and not FLAGS.enforce_eager)


def _lora_modules(config: ServerConfig) -> tuple[str, ...]:
    """--lora_modules, refused before the model loads without --enable_lora or for a
    directory that is not there (the adapter itself is read once the engine is up)."""
    modules = config.lora_adapters
    if modules and not engine_config().enable_lora:
        raise app.UsageError("--lora_modules needs --enable_lora (the engine serves no "
                             "adapters without it)")
    for module in modules:
        if not os.path.isdir(module.path):
            raise app.UsageError(f"--lora_modules {module.name}={module.path}: no such "
                                 "directory")
    return config.lora_modules


def _follow() -> None:
    """A follower of a multi-host server: no HTTP, process 0's engine operations applied
    before each step. SIGTERM does not stop it (a slice's stop reaches every host at
    once, and process 0 drains first): it returns when process 0 says shutdown. A step
    that fails or hangs past --heartbeat_timeout_s exits non-zero at once (JAX's
    shutdown barrier would wait for the peer that is gone)."""
    from jaxinfer import distributed
    from jaxinfer.engine.parallel import lockstep
    from jaxinfer.engine.parallel.channel import KeyValueChannel

    signal.signal(signal.SIGTERM, lambda sig, frame: logging.info(
        "follower: SIGTERM ignored; process 0 drains and then stops every process"))
    llm = make_llm()
    distributed.barrier(WARM)
    timeout = FLAGS.heartbeat_timeout_s
    watchdog = lockstep.Watchdog(timeout, lambda seconds: _exit_failed(
        f"a step has run for {seconds:.0f}s, longer than --heartbeat_timeout_s={timeout}"))
    sys.stderr.write("jaxinfer: following process 0's server\n")
    sys.stderr.flush()
    try:
        steps = lockstep.follow(llm.engine, KeyValueChannel(), watchdog=watchdog)
    except Exception as e:
        logging.exception("follower failed")
        _exit_failed(f"{type(e).__name__}: {e}")
    logging.info("follower: ran %d steps", steps)


def _exit_failed(why: str) -> typing.NoReturn:
    sys.stderr.write(f"jaxinfer: serve: the multi-host engine failed: {why}\n")
    sys.stderr.flush()
    os._exit(1)

