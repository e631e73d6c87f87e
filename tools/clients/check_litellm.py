"""LiteLLM against jaxinfer: `litellm.completion` through its OpenAI-compatible provider
(`openai/<served name>`, `api_base`), whole and streamed, greedy (the stream's text is
the whole response's), with usage; `litellm.text_completion` on /v1/completions.

    python3 -m venv /work/venv-litellm
    /work/venv-litellm/bin/pip install -r tools/clients/requirements-litellm.txt
    /work/venv-litellm/bin/python tools/clients/check_litellm.py [--url URL]
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the cost map

from importlib import metadata  # noqa: E402

import litellm  # noqa: E402
from serve import Report, arguments, expect, server  # noqa: E402

MESSAGES = [{"role": "user", "content": "def fibonacci(n):"}]


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    report = Report("litellm", metadata.version("litellm"))
    with server(args) as (url, model):
        common = dict(model=f"openai/{model}", api_base=f"{url}/v1", api_key="unused",
                      max_tokens=16, temperature=0)
        whole: dict[str, str] = {}

        def plain() -> dict:
            response = litellm.completion(messages=MESSAGES, **common)
            text = response.choices[0].message.content
            expect(bool(text), "empty content")
            expect(response.usage.completion_tokens == 16, f"usage {response.usage}")
            whole["text"] = text
            return {"content": text, "usage": response.usage.model_dump()}

        def streamed() -> dict:
            chunks = list(litellm.completion(messages=MESSAGES, stream=True,
                                             stream_options={"include_usage": True}, **common))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            expect(text == whole.get("text"), f"streamed {text!r} != whole {whole!r}")
            return {"chunks": len(chunks), "content": text}

        def text_completion() -> dict:
            response = litellm.text_completion(prompt="import os\n", **common)
            text = response.choices[0].text
            expect(bool(text), "empty text")
            return {"text": text}

        report.check("completion", plain)
        report.check("completion_stream", streamed)
        report.check("text_completion", text_completion)
    report.finish()


if __name__ == "__main__":
    main()
