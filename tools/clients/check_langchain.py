"""LangChain's ChatOpenAI against jaxinfer: invoke and stream (greedy: the stream's text
is the invoked one's), structured output (`with_structured_output`, as a JSON schema and
as a function call) and tool calls (`bind_tools` with a named and a required choice).

    python3 -m venv /work/venv-langchain
    /work/venv-langchain/bin/pip install -r tools/clients/requirements-langchain.txt
    /work/venv-langchain/bin/python tools/clients/check_langchain.py [--url URL]
"""

from __future__ import annotations

from importlib import metadata
from typing import Literal

import pydantic
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from serve import Report, arguments, expect, server

QUESTION = "def fibonacci(n):"


class Verdict(pydantic.BaseModel):
    """A one-word review of a code snippet."""

    language: Literal["python", "c", "rust"]
    lines: int


@tool
def run_tests(path: str, verbose: bool) -> str:
    """Run the test suite under `path`."""
    return f"ran {path}"


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    report = Report("langchain-openai", metadata.version("langchain-openai"))
    with server(args) as (url, model):
        def chat(max_tokens: int) -> ChatOpenAI:
            return ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused",
                              temperature=0, max_tokens=max_tokens, max_retries=0, timeout=120)

        llm, roomy = chat(24), chat(96)  # room for a whole JSON answer
        whole: dict[str, str] = {}

        def invoke() -> dict:
            message = llm.invoke(QUESTION)
            expect(isinstance(message.content, str) and message.content, "empty content")
            expect(message.usage_metadata["output_tokens"] == 24, f"{message.usage_metadata}")
            whole["text"] = message.content
            return {"content": message.content, "usage": message.usage_metadata}

        def stream() -> dict:
            chunks = list(llm.stream(QUESTION))
            text = "".join(chunk.content for chunk in chunks)
            expect(text == whole.get("text"), f"streamed {text!r} != invoked {whole!r}")
            return {"chunks": len(chunks), "content": text}

        def structured(method: str) -> dict:
            out = roomy.with_structured_output(Verdict, method=method).invoke(
                f"Review this code: {QUESTION}")
            expect(isinstance(out, Verdict), f"{out!r} is not a Verdict")
            return out.model_dump()

        def tool_calls(choice: str) -> dict:
            message = roomy.bind_tools([run_tests], tool_choice=choice).invoke(
                "Run the tests in tests/ quietly.")
            expect(len(message.tool_calls) >= 1, f"no tool calls: {message!r}")
            call = message.tool_calls[0]
            expect(call["name"] == "run_tests", f"{call}")
            expect(set(call["args"]) == {"path", "verbose"}, f"{call}")
            return {"tool_calls": message.tool_calls}

        report.check("invoke", invoke)
        report.check("stream", stream)
        report.check("structured_output_json_schema", lambda: structured("json_schema"))
        report.check("structured_output_function_calling",
                     lambda: structured("function_calling"))
        report.check("bind_tools_named", lambda: tool_calls("run_tests"))
        report.check("bind_tools_required", lambda: tool_calls("required"))
    report.finish()


if __name__ == "__main__":
    main()
