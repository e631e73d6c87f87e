"""Compiling and checking a constraint in a child process (`python -m
jaxinfer.engine.structured.compile_process`) with `COMPILE_STACK_BYTES` of stack, within
`COMPILE_TIMEOUT_S`, before any compile in the engine's process: a crash or time-out is
a ValueError naming the field, and a fresh child serves the next constraint.
See docs/structured_outputs.md#limits.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import threading
from typing import TextIO

import llguidance

log = logging.getLogger(__name__)
COMPILE_TIMEOUT_S = 10.0  # a child's time for one constraint
COMPILE_STACK_BYTES = 8 * 2**20  # the child's compiling thread (a common default)
NATIVE_STACK_BYTES = 8 * COMPILE_STACK_BYTES  # the engine's grammar thread
PROCESSES = 2  # children compiling at once
START_TIMEOUT_S = 60.0  # a child's start: import llguidance, read the tokenizer
JSON_DEFAULTS = {"whitespace_flexible": False}
# llguidance's parser limits, given explicitly: per-mask work is bounded by the two
# step limits (~15 ms of lexer work and ~2.5 ms of Earley items a row, by llguidance's
# own speed figures), a matcher's lexer by `max_lexer_states` (~1-2 kB each).
# verbose_errors=False: an error is one line, without the parser's state and grammar.
LIMITS = {"step_lexer_fuel": 200_000, "step_max_items": 50_000,
          "max_lexer_states": 50_000, "max_grammar_size": 500_000,
          "verbose_errors": False}


def limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**LIMITS)


def to_grammar(kind: str, text: str) -> str:
    """The llguidance grammar of a spec (`StructuredOutputsParams.spec()`). JSON is
    compact (no whitespace between tokens but the separators', vLLM's
    `disable_any_whitespace`): with free whitespace a small model pads a document until
    max_tokens. `grammar` is EBNF (GBNF) or Lark, told apart by llguidance. `choice` is
    one Lark terminal, an alternation of the strings: the lexer matches it, where a
    rule of one alternative per string would make a parser row per choice (llguidance
    refuses rows of over 2,000 items)."""
    if kind in ("json", "json_object"):
        schema = json.loads(text) if kind == "json" else {"type": "object"}
        if schema is True:
            schema = {}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "choice":
        strings = " | ".join(json.dumps(s) for s in json.loads(text))
        return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {strings}\n")
    return llguidance.grammar_from(kind, text)


def check(kind: str, text: str, tokenizer: llguidance.LLTokenizer) -> str:
    """The grammar of a spec, compiled, validated and matched once; ValueError (without
    the field) if it cannot be used: invalid, or no output satisfies it (a JSON schema
    whose only instance is infinite, `{"$ref": "#"}`, stops the matcher at its first
    mask)."""
    grammar = to_grammar(kind, text)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits())
    if error:
        raise ValueError(error.strip())
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
    matcher.compute_bitmask()
    if matcher.is_error():
        raise ValueError(f"no output satisfies it ({first_line(matcher.get_error())})")
    return grammar


def first_line(message: str, limit: int = 300) -> str:
    """One bounded line of an llguidance error (for logs and 400s)."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line if len(line) <= limit else line[:limit] + "..."


class GrammarProcesses:
    """Up to `PROCESSES` children, each compiling one constraint at a time."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_id: int | None
                 ) -> None:
        self._args = [tokenizer_path, str(vocab_size), str(eos_token_id)]
        self._idle: queue.Queue[_Child] = queue.Queue()
        for _ in range(PROCESSES):
            self._idle.put(_Child(self._args))
        self.crashes = self.timeouts = 0

    def compile(self, kind: str, text: str) -> str:
        """The checked grammar; ValueError (without the field) if it fails, crashes the
        child or takes longer than COMPILE_TIMEOUT_S."""
        child = self._idle.get()
        try:
            reply = child.ask({"kind": kind, "text": text})
        finally:
            self._idle.put(child)
        if reply.get("crashed"):
            self.crashes += 1
        if reply.get("timed_out"):
            self.timeouts += 1
        if "error" in reply:
            raise ValueError(reply["error"])
        return reply["grammar"]

    def close(self) -> None:
        for _ in range(PROCESSES):
            self._idle.get().stop()


class _Child:
    """One child process, started on first use and again after it died."""

    def __init__(self, args: list[str]) -> None:
        self._args = args
        self._process: subprocess.Popen | None = None

    def ask(self, request: dict) -> dict:
        process = self._start()
        try:
            process.stdin.write(json.dumps(request) + "\n")
            process.stdin.flush()
        except OSError:  # it died since its last answer
            return self._lost(process, timed_out=False)
        ready, _, _ = select.select([process.stdout], [], [], COMPILE_TIMEOUT_S)
        line = process.stdout.readline() if ready else ""
        if not line:
            return self._lost(process, timed_out=not ready)
        return json.loads(line)

    def _start(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "jaxinfer.engine.structured.compile_process", *self._args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                start_new_session=True)  # a terminal's Ctrl-C goes to the server alone
            ready, _, _ = select.select([self._process.stdout], [], [], START_TIMEOUT_S)
            if not ready or self._process.stdout.readline().strip() != "ready":
                self.stop()
                raise RuntimeError("the grammar-compiling process did not start")
        return self._process

    def _lost(self, process: subprocess.Popen, *, timed_out: bool) -> dict:
        """The child crashed or ran out of time on a request: end it, say why."""
        self.stop()
        if timed_out:
            log.warning("a constraint took over %.0f s to compile; refused", COMPILE_TIMEOUT_S)
            return {"timed_out": True, "error": f"compiling it took longer than "
                    f"{COMPILE_TIMEOUT_S:.0f} s (the limit); make it smaller or less deep"}
        code = process.returncode
        how = signal.Signals(-code).name if code is not None and code < 0 else f"exit {code}"
        log.warning("the grammar compiler crashed (%s) on a constraint; refused", how)
        return {"crashed": True, "error": f"the grammar compiler crashed on it ({how}): "
                "it is nested too deeply or too large; make it shallower or smaller"}

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
        if process is not None:
            process.wait()
            for pipe in (process.stdin, process.stdout):
                pipe.close()


def _serve(tokenizer: llguidance.LLTokenizer, replies: TextIO) -> None:
    """The child's loop: one JSON request a line in, one JSON reply a line out."""
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        reply: dict = {}

        def run(request: dict = request, reply: dict = reply) -> None:
            try:
                reply["grammar"] = check(request["kind"], request["text"], tokenizer)
            except Exception as e:  # any failure refuses the constraint
                reply["error"] = str(e) or type(e).__name__

        thread = threading.Thread(target=run)  # with COMPILE_STACK_BYTES (main sets it)
        thread.start()
        thread.join()
        print(json.dumps(reply), file=replies, flush=True)


def main(argv: list[str]) -> None:
    tokenizer_path, vocab_size, eos = argv
    replies = os.fdopen(os.dup(1), "w")  # the parent reads replies alone on stdout:
    os.dup2(2, 1)  # anything else written there goes to stderr
    with open(tokenizer_path, encoding="utf-8") as f:
        tokenizer = llguidance.LLTokenizer(f.read(), n_vocab=int(vocab_size),
                                           eos_token=None if eos == "None" else int(eos))
    threading.stack_size(COMPILE_STACK_BYTES)
    _serve(tokenizer, replies)


if __name__ == "__main__":
    main(sys.argv[1:])
