"""Keeping secrets out of every line the product prints or logs (SPEC: "no secret in any log at any level").

Pure text functions and one :class:`logging.Filter`; no I/O, imports nothing of the package (base layer).

* :func:`redact_url`: the user info of a URL (``http://user:password@host`` -> ``http://***@host``) and
  the secret query parameters of a presigned URL (``X-Amz-Signature``, ``X-Amz-Credential``,
  ``X-Amz-Security-Token``, ``AWSAccessKeyId``, ``Signature``) replaced by ``***``.
* :func:`redact_text`: every URL inside a free text through :func:`redact_url`, plus the credential
  fragments botocore's wire logging prints (``Authorization: AWS4-HMAC-SHA256 Credential=...,
  Signature=...``, ``x-amz-security-token: ...``, ``aws_secret_access_key=...``) and any literal secret
  value registered with :func:`register_secret` (the CLI registers the ``AWS_*`` credentials it finds in
  the environment, so that a secret echoed in some library's message is caught as well).
* :class:`RedactingFilter`: a handler filter that renders each record's message (and exception text)
  and passes it through :func:`redact_text`. The CLI attaches it to its handler; library code configures
  no handler at all.

Source: AWS Signature Version 4 (``Authorization`` header, presigned query parameters), RFC 3986 §3.2.1
(user information in a URI).
"""

from __future__ import annotations

import logging
import re
import threading

MASK = "***"

_URL_RE = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_USERINFO_RE = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/?#@]*)@")
_SECRET_QUERY_RE = re.compile(
    r"(?P<name>(?:X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|AWSAccessKeyId|Signature|"
    r"x-amz-signature|x-amz-credential|x-amz-security-token)=)(?P<value>[^&#\s'\"]*)")
_TEXT_PATTERNS: tuple[re.Pattern[str], ...] = (
    # Authorization: AWS4-HMAC-SHA256 Credential=AKIA.../20260101/us-east-1/s3/aws4_request, SignedHeaders=..., Signature=...
    re.compile(r"(?i)(?P<name>Credential=)(?P<value>[^,\s'\"]+)"),
    re.compile(r"(?i)(?P<name>Signature=)(?P<value>[0-9a-f]+)"),
    re.compile(r"(?i)(?P<name>\bAuthorization['\"]?\s*[:=]\s*['\"]?)(?P<value>[^'\"\n]+)"),
    re.compile(r"(?i)(?P<name>x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)(?P<value>[^'\",\s}]+)"),
    re.compile(r"(?i)(?P<name>aws_(?:secret_access_key|session_token|access_key_id)['\"]?\s*[:=]\s*['\"]?)"
               r"(?P<value>[^'\",\s}]+)"),
)
#: Literal values shorter than this are not registered (they would mask ordinary words).
MIN_SECRET_LEN = 4

_secrets: set[str] = set()
_secrets_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Mask ``value`` wherever :func:`redact_text` sees it from now on (process-wide). Values shorter than
    :data:`MIN_SECRET_LEN` characters are ignored."""
    if value and len(value) >= MIN_SECRET_LEN:
        with _secrets_lock:
            _secrets.add(value)


def _mask_group(m: re.Match[str]) -> str:
    return m.group("name") + MASK


def redact_url(url: str) -> str:
    """``url`` without user info or presigned-URL secrets (see the module docstring). Any string is
    accepted; one that is not a URL comes back unchanged."""
    out = _USERINFO_RE.sub(lambda m: m.group("scheme") + MASK + "@", url, count=1)
    return _SECRET_QUERY_RE.sub(_mask_group, out)


def redact_text(text: str) -> str:
    """``text`` with every URL passed through :func:`redact_url`, credential fragments masked and every
    registered secret value replaced by ``***``."""
    out = _URL_RE.sub(lambda m: redact_url(m.group(0)), text)
    for pattern in _TEXT_PATTERNS:
        out = pattern.sub(_mask_group, out)
    with _secrets_lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for value in secrets:
        if value in out:
            out = out.replace(value, MASK)
    return out


class RedactingFilter(logging.Filter):
    """Renders a record's message (``msg % args``) and its exception text, and redacts both with
    :func:`redact_text`. Attach it to a handler (``handler.addFilter(RedactingFilter())``) so that it sees
    records of every logger that handler serves, botocore's included. Never drops a record."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: keep what there is, redacted
            message = str(record.msg)
        record.msg, record.args = redact_text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


__all__ = ["MASK", "MIN_SECRET_LEN", "RedactingFilter", "redact_text", "redact_url", "register_secret"]
