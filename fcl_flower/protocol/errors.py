"""Errors of the message protocol: one line each, naming what is wrong."""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message that does not follow the protocol (missing record, wrong type, wrong round)."""


class UploadError(ProtocolError):
    """A client's reply that must not be aggregated; the server rejects it and names the client.

    ``client`` is set by the server to the name the rejection is logged and recorded under.
    """

    client: str | None = None
