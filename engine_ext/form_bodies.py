"""Form bodies (vLLM's audio endpoints) for the HTTP guard: read with the parser
FastAPI uses for the endpoint, and written back whole, so that what vLLM parses
is exactly what the guard checked.

A multipart body is never patched in place: two multipart parsers can disagree
about where a part starts or what it is named, and a patch would let a client
hide a field from one of them. The guard reads the form with Starlette's own
parser (the one FastAPI calls, with the same limits) and encodes every field
anew, in order, under a fresh boundary.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from typing import NamedTuple

from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import Message, Scope

#: Characters a field name or file name must not hold: the encoder would have
#: to escape them, and parsers disagree on how escapes read back.
_UNQUOTABLE = frozenset('"\\\r\n')


class EncodedForm(NamedTuple):
    """A form encoded as ``multipart/form-data``."""

    body: bytes
    content_type: bytes


async def read_form(scope: Scope, body: bytes) -> FormData | None:
    """The form ``body`` holds, as FastAPI reads it for a request with
    ``scope``'s headers; None when that parser refuses it (vLLM then refuses
    the same bytes itself)."""

    async def receive() -> Message:
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        return await Request(scope, receive).form()
    except HTTPException:  # a malformed multipart body, too many parts...
        return None


def unquotable_name(form: FormData) -> str | None:
    """The first field or file name of ``form`` that ``encode_form`` could not
    write as it was read, if any."""
    for name, value in form.multi_items():
        names = [name]
        if isinstance(value, UploadFile) and value.filename is not None:
            names.append(value.filename)
        for text in names:
            if _UNQUOTABLE.intersection(text):
                return text
    return None


async def encode_form(
    fields: Iterable[tuple[str, str | UploadFile]],
) -> EncodedForm:
    """``fields`` as a ``multipart/form-data`` body (RFC 7578); names hold no
    character of ``_UNQUOTABLE`` (checked by ``unquotable_name``)."""
    boundary = f"output-rate-{secrets.token_hex(16)}"
    parts: list[bytes] = []
    for name, value in fields:
        disposition = f'form-data; name="{name}"'
        headers = []
        if isinstance(value, UploadFile):
            if value.filename is not None:
                disposition += f'; filename="{value.filename}"'
            headers.append(
                f"Content-Type: {value.content_type or 'application/octet-stream'}"
            )
            await value.seek(0)
            data = await value.read()
        else:
            data = value.encode("utf-8")
        head = "\r\n".join([f"Content-Disposition: {disposition}", *headers])
        parts.append(
            b"--"
            + boundary.encode()
            + b"\r\n"
            + head.encode("utf-8")
            + b"\r\n\r\n"
            + data
            + b"\r\n"
        )
    parts.append(b"--" + boundary.encode() + b"--\r\n")
    content_type = f"multipart/form-data; boundary={boundary}".encode()
    return EncodedForm(b"".join(parts), content_type)
