"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the chat
route: protocol.py reads the bodies, translation.py makes them chat requests, routes.py
answers them through the chat handler, streaming.py and errors.py speak Anthropic's
events and errors. See docs/serving.md#anthropics-messages-api.
"""

from jaxinfer.server.anthropic.routes import handlers

__all__ = ["ROUTES", "handlers"]
ROUTES = {"/v1/messages": ("POST",), "/v1/messages/count_tokens": ("POST",)}
