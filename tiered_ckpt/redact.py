"""Keeping secrets out of every line the product prints or logs (SPEC: "no secret in any log at any
level"). Pure text functions and one :class:`logging.Filter`; no I/O, imports nothing of the package.

* :func:`redact_url`: a URL's user info and a presigned URL's secret query parameters -> ``***``.
* :func:`redact_urls`: every URL inside a free text through :func:`redact_url`, nothing else.
* :func:`redact_text`: :func:`redact_urls` plus the credential fragments botocore's wire logging and
  STS / instance-metadata responses print, and every literal value registered with
  :func:`register_secret`, raw or percent-encoded.
* :class:`RedactingFilter`: renders each record's message and exception text through
  :func:`redact_text`. The CLI attaches it to its handler; library code configures no handler.

What is matched, and the sources: docs/design.md, "Redaction".
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import quote, quote_plus, unquote, urlsplit

MASK = "***"

_URL_RE = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")
_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_SECRET_QUERY_RE = re.compile(
    r"(?i)(?<![\w-])(?P<name>(?:X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|AWSAccessKeyId|Signature)=)"
    r"(?P<value>[^&#\s'\"]*)"
)
#: value characters of a header / parameter: up to a quote, comma, brace, ``&`` or white space
_VALUE = r"(?P<value>[^'\",\s}&]+)"
_TEXT_PATTERNS: tuple[re.Pattern[str], ...] = (
    # Authorization: AWS4-HMAC-SHA256 Credential=AKIA.../20260101/us-east-1/s3/aws4_request,
    # SignedHeaders=..., Signature=... and the dict form of botocore's "Sending http request":
    # 'Authorization': b'AWS4-HMAC-SHA256 ...'
    re.compile(
        r"(?i)(?P<name>\b(?:Proxy-)?Authorization['\"]?\s*[:=]\s*b?['\"]?)(?P<value>[^'\"\n]+)"
    ),
    re.compile(r"(?i)(?<![\w-])(?P<name>(?:X-Amz-)?Credential=)" + _VALUE),
    re.compile(r"(?i)(?<![\w-])(?P<name>(?:X-Amz-)?Signature=)" + _VALUE),
    # botocore.auth: "Signature:\n<64 hex digits>"
    re.compile(r"(?i)(?P<name>\bSignature:\s*)(?P<value>[0-9a-f]{16,})"),
    # canonical request "x-amz-security-token:...", headers dict "'X-Amz-Security-Token': b'...'",
    # SSE-C keys
    re.compile(
        r"(?i)(?P<name>\b(?:x-amz-security-token|x-amz-(?:copy-source-)?server-side-encryption-customer-key)"
        r"['\"]?\s*[:=]\s*b?['\"]?)" + _VALUE
    ),
    # config files / keyword arguments: aws_secret_access_key = ..., aws_session_token=...
    re.compile(
        r"(?i)(?P<name>\baws_(?:secret_access_key|session_token|security_token|access_key_id)['\"]?\s*[:=]\s*"
        r"b?['\"]?)" + _VALUE
    ),
    # STS responses (XML): <SecretAccessKey>...</SecretAccessKey>, <SessionToken>, <AccessKeyId>
    re.compile(
        r"(?P<name><(?:SecretAccessKey|SessionToken|AccessKeyId|SecurityToken)>)(?P<value>[^<]*)"
    ),
    # container / instance-metadata / SSO credentials (JSON): "SecretAccessKey": "...", "Token":
    # "..."
    re.compile(
        r"(?P<name>['\"](?:SecretAccessKey|SessionToken|AccessKeyId|Token|secretAccessKey|sessionToken|"
        r"accessKeyId)['\"]\s*:\s*['\"])(?P<value>[^'\"]*)"
    ),
)
#: Literal values shorter than this are not registered: they would mask ordinary words (a demo's
#: ``AWS_ACCESS_KEY_ID=demo`` would turn every ``tiered-ckpt-demo`` path into ``tiered-ckpt-***``).
#: Real AWS keys are 20 (id) and 40 (secret) characters, MinIO secrets at least 8; a shorter
#: credential is still masked where botocore prints it (``Credential=``, tokens, ``Authorization``),
#: only not as a bare word elsewhere.
MIN_SECRET_LEN = 8

_secrets: set[str] = set()
_secrets_lock = threading.Lock()


def register_secret(value: str | None) -> None:
    """Mask ``value`` wherever :func:`redact_text` sees it from now on (process-wide), raw and
    percent-encoded (``quote(value, safe="")``, ``quote(value)``, ``quote_plus(value)``: the forms a
    URL or a query string carries). Values shorter than :data:`MIN_SECRET_LEN` characters are
    ignored."""
    if not value or len(value) < MIN_SECRET_LEN:
        return
    forms = {value, quote(value, safe=""), quote(value), quote_plus(value)}
    with _secrets_lock:
        _secrets.update(forms)


def register_url_credentials(url: str | None) -> None:
    """Register the user name and password of ``url``'s user info (``http://user:password@host``)
    with :func:`register_secret`, as written and percent-decoded. A URL without user info, or a
    string that is not a URL, registers nothing."""
    if not url:
        return
    url = url.strip()
    span = _userinfo_span(url)
    if span is None:
        return
    userinfo = url[span[0] : span[1]]
    user, _, password = userinfo.partition(":")
    for part in (userinfo, user, password):
        register_secret(part)
        register_secret(unquote(part))
    try:  # what urllib (and so botocore / urllib3) makes of it, if it parses differently
        parts = urlsplit(url)
        register_secret(parts.username)
        register_secret(parts.password)
    except ValueError:
        pass


def _mask_group(m: re.Match[str]) -> str:
    return m.group("name") + MASK


def _userinfo_span(url: str) -> tuple[int, int] | None:
    """``(start, end)`` of the user info in ``url`` (``url[end]`` is its ``@``), or ``None``.

    RFC 3986: the authority ends at the first ``/``, ``?`` or ``#`` and its user info runs to the
    last ``@`` in it. A password with an unencoded ``/`` (``http://user:pa/ss@host``, common with
    AWS secret keys pasted into a URL) ends that authority early at ``user:pa``, which is no
    ``host:port`` (the "port" is not a number): then the user info runs to the first ``@`` after
    it."""
    m = _SCHEME_RE.match(url)
    if m is None:
        return None
    start = m.end()
    end = len(url)
    for i in range(start, len(url)):
        if url[i] in "/?#" or url[i].isspace():
            end = i
            break
    at = url.rfind("@", start, end)
    if at >= 0:
        return start, at
    _host, colon, port = url[start:end].partition(":")
    if colon and not port.isdigit():
        at = url.find("@", end)
        stop = next((i for i in range(end, at) if url[i].isspace()), None) if at >= 0 else None
        if at >= 0 and stop is None:
            return start, at
    return None


def redact_url(url: str) -> str:
    """``url`` without user info or presigned-URL secrets (see the module docstring). Any string is
    accepted; one that is not a URL comes back unchanged."""
    span = _userinfo_span(url)
    out = url if span is None else url[: span[0]] + MASK + url[span[1] :]
    return _SECRET_QUERY_RE.sub(_mask_group, out)


def redact_urls(text: str) -> str:
    """``text`` with every URL in it passed through :func:`redact_url` and nothing else changed (for
    data output, where only a URL's user info or presigned secrets are masked)."""
    return _URL_RE.sub(lambda m: redact_url(m.group(0)), text)


def redact_text(text: str) -> str:
    """``text`` with every URL passed through :func:`redact_url`, credential fragments masked and
    every registered secret value replaced by ``***``."""
    out = redact_urls(text)
    out = _SECRET_QUERY_RE.sub(
        _mask_group, out
    )  # a query string outside a URL ("GET /b/k?X-Amz-...")
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
    :func:`redact_text`. Attach it to a handler (``handler.addFilter(RedactingFilter())``) so that
    it sees records of every logger that handler serves, botocore's included. Never drops a
    record."""

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


__all__ = [
    "MASK",
    "MIN_SECRET_LEN",
    "RedactingFilter",
    "redact_text",
    "redact_url",
    "redact_urls",
    "register_secret",
    "register_url_credentials",
]
