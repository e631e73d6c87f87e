"""OpenAI's Responses API (/v1/responses) over the chat completions path: the body
(protocol.py), its translation into a chat request (translation.py), output items and
the response object (output.py), stream events (events.py), the bounded store of
responses (store.py) and the routes (routes.py). See docs/serving.md#the-responses-api.
"""
