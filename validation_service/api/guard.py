"""Access control of the HTTP API: one ASGI middleware, ``ApiGuard``, around the whole app.

It checks the Host header, the Bearer token (``CKVAL_API_TOKEN``), cross-site requests and
the body type of mutating requests before any route runs, for HTTP requests and WebSocket
handshakes alike. Being app-wide, it covers every route on the app, also those added after
``create_app`` returns (``@app.get``, ``@app.websocket``, ``app.include_router``,
``app.mount``): a later route needs nothing of its own. Only ``PUBLIC_PATHS`` are open.
Guarded answers carry SECURITY_HEADERS (a Content-Security-Policy among them).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import time
from urllib.parse import quote, urlencode, urlsplit

from fastapi.responses import JSONResponse, RedirectResponse
from starlette.requests import HTTPConnection
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from validation_service.config import Settings
from validation_service.errors import InvalidInput

logger = logging.getLogger(__name__)

# Paths open without a token and from any Host: a liveness probe sends the pod's IP as
# Host, and /healthz tells nothing but ok / not ok.
PUBLIC_PATHS = frozenset({"/healthz"})
# GET <UI_PREFIX>...?token=T sets the TOKEN_COOKIE, so that a browser can open the dashboard.
UI_PREFIX = "/ui"
TOKEN_COOKIE = "ckval_token"
TOKEN_COOKIE_MAX_AGE_S = 12 * 3600
# A cookie issued by a server whose clock runs this much ahead is still taken.
COOKIE_CLOCK_SKEW_S = 300
MIN_TOKEN_LENGTH = 16
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# Bind addresses that mean "every interface": not a name a client sends as Host.
_WILDCARD_BIND = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The body of a mutating request: read whole before any route runs, and refused (413)
# beyond this, whatever Content-Length says (a chunked body is counted as it comes).
MAX_BODY_BYTES = 1024 * 1024
_WWW_AUTHENTICATE = 'Bearer realm="ckval"'


def checked_api_token(settings: Settings) -> str | None:
    """The API token of ``settings`` (None when unset); InvalidInput when too short to guess."""
    if settings.api_token is None:
        return None
    token = settings.api_token.get_secret_value()
    if len(token) < MIN_TOKEN_LENGTH:
        raise InvalidInput(
            f"CKVAL_API_TOKEN has {len(token)} characters; use at least {MIN_TOKEN_LENGTH} "
            "random ones, e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`."
        )
    return token


def allowed_hosts(settings: Settings) -> frozenset[str] | None:
    """The host names the API answers in the Host header (lower case); None: any."""
    if settings.api_hosts is None:
        hosts = set(LOOPBACK_HOSTS)
        if settings.http_host not in _WILDCARD_BIND:
            hosts.add(settings.http_host)
    else:
        hosts = set(settings.api_hosts)
    if "*" in hosts:
        return None
    return frozenset(_host_name(host) for host in hosts)


def check_bind(settings: Settings, host: str | None = None) -> None:
    """Refuses to serve the API on ``host`` (default ``settings.http_host``) when that
    reaches beyond this machine and no token guards it; also checks the token itself.

    ``ckval serve`` calls this before it starts anything.
    """
    host = settings.http_host if host is None else host
    if checked_api_token(settings) is not None or _is_loopback(host):
        return
    raise InvalidInput(
        f"Refusing to serve the HTTP API on {host!r} without a token: anyone who can reach "
        "that address could read every run and cancel or retry its validations. Set "
        "CKVAL_API_TOKEN to a long random secret (clients then send "
        "`Authorization: Bearer <token>`), or bind to 127.0.0.1 (--host / CKVAL_HTTP_HOST)."
    )


# What a page of this API may load and do: scripts, styles, images and requests of this
# origin only (the dashboard's files and /docs come from the package, never a CDN), no
# inline script, no plugins, no framing, forms only to this origin.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
# Sent with every answer of a guarded route: the policy above, no framing by another site
# (clickjacking of the dashboard's buttons), no MIME sniffing, and no URL (which may carry
# ?token=) in the Referer of links followed from a page.
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


def _with_security_headers(send: Send) -> Send:
    async def send_with_headers(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
        await send(message)

    return send_with_headers


def _is_loopback(host: str) -> bool:
    name = _host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a DNS name other than localhost may resolve anywhere


def _host_name(host: str) -> str:
    """The name in a Host header or address: without port and IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        return host.partition(":")[0]
    return host


def _now() -> float:
    return time.time()


def _dashboard_cookie(token: str, issued_at: int) -> str:
    # The cookie holds a value derived from the token, not the token: a leaked cookie is
    # not a Bearer token, it stops working when the token is rotated, and the time it was
    # issued is signed with it, so that the server refuses it after its lifetime.
    message = b"ckval dashboard cookie\x00" + str(issued_at).encode()
    return f"{issued_at}.{hmac.new(token.encode(), message, hashlib.sha256).hexdigest()}"


def _cookie_is_valid(cookie: str, token: str) -> bool:
    """Whether ``cookie`` was issued for ``token`` within TOKEN_COOKIE_MAX_AGE_S."""
    issued, dot, _mac = cookie.partition(".")
    if not dot or not issued.isdigit() or len(issued) > 12:
        return False
    age = _now() - int(issued)
    if not -COOKIE_CLOCK_SKEW_S <= age <= TOKEN_COOKIE_MAX_AGE_S:
        return False
    return _same(cookie, _dashboard_cookie(token, int(issued)))


def _client_is_local(conn: HTTPConnection) -> bool:
    """Whether the peer is this machine: a loopback address, or no network address at
    all (a Unix socket, an in-process client)."""
    if conn.client is None or not conn.client.host:
        return True
    try:
        address = ipaddress.ip_address(conn.client.host.split("%")[0])
    except ValueError:
        return True  # no IP address: not a network peer
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


class ApiGuard:
    """ASGI middleware around the whole API: Host allow-list, token, CSRF, body type.

    In order, for every HTTP request and WebSocket handshake but PUBLIC_PATHS:

    1. Host must be one of ``hosts`` (400): a page on another name that a DNS rebinding
       points at this server is refused.
    2. A mutating request (any method but GET, HEAD, OPTIONS) from another origin is
       refused (403): its Origin must match Host, and Sec-Fetch-Site, when a browser
       sends it, must say same-origin.
    3. With a ``token``: ``Authorization: Bearer <token>``, compared in constant time, else
       401 with ``WWW-Authenticate: Bearer``. A browser cannot send that header when it
       navigates, so ``GET /ui...?token=<token>`` sets an HttpOnly, SameSite=Strict cookie
       and redirects to the same URL without the token; the cookie then stands for the
       token on GET requests, and on a mutating one only together with an
       X-Requested-With header or a JSON body (see ``_cookie_may_mutate``).
    4. A mutating request has no body or a JSON one (415 otherwise): an HTML form can
       only send form or text bodies, so it cannot reach a route at all.
    5. A mutating request's body is at most MAX_BODY_BYTES (413 otherwise), read here
       before the route runs.

    A WebSocket handshake (a route added with ``@app.websocket`` after create_app, say)
    meets the same checks as a mutating request, since a browser sends the cookie along
    from any page: Host, same origin, then the token or the cookie. A refused one is
    closed before it is accepted (code 1008, an HTTP 403 to the client).
    """

    def __init__(self, app: ASGIApp, *, token: str | None, hosts: frozenset[str] | None):
        self.app = app
        self.token = token
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] in ("http", "websocket")
        if not guarded or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        refusal = self._refusal(conn)
        if refusal is not None:
            logger.info(
                "refused %s %s from %s: %s",
                scope.get("method", "WebSocket"),
                scope["path"],
                conn.client.host if conn.client else "?",
                refusal.status_code,
            )
            if scope["type"] == "websocket":
                await receive()  # the handshake's websocket.connect
                await send({"type": "websocket.close", "code": 1008})
            else:
                await refusal(scope, receive, send)
            return
        if scope["type"] == "http" and scope.get("method") not in _SAFE_METHODS:
            receive = await _bounded_body(receive, conn)
            if receive is None:
                await _too_large()(scope, _nothing_more, send)
                return
        await self.app(scope, receive, _with_security_headers(send))

    def _refusal(self, conn: HTTPConnection) -> Response | None:
        host = conn.headers.get("host", "")
        if self.hosts is not None and _host_name(host) not in self.hosts:
            return _error(
                400,
                "BadHost",
                f"Host {host!r} is not one this API answers to. Add it to CKVAL_API_HOSTS "
                "(comma-separated names, or * for any) on the server, or use one of: "
                f"{', '.join(sorted(self.hosts))}.",
            )
        if self.token is None and not _client_is_local(conn):
            # However the app is served: without a token it answers this machine only.
            return _error(
                403,
                "TokenRequired",
                "This API has no token, so it answers clients on this machine only. Set "
                "CKVAL_API_TOKEN on the server to serve other machines (they then send "
                "`Authorization: Bearer <token>`).",
            )
        mutating = conn.scope.get("method") not in _SAFE_METHODS  # a WebSocket has none
        if mutating and not _same_origin(conn, host):
            return _error(
                403,
                "CrossSiteRequest",
                "A cross-site request may not change jobs: its Origin "
                f"({conn.headers.get('origin')!r}) or Sec-Fetch-Site "
                f"({conn.headers.get('sec-fetch-site')!r}) is not this API's own. Call the "
                "API from a script or the command line, not from another site's page.",
            )
        if self.token is not None:
            denied = self._authenticate(conn, mutating)
            if denied is not None:
                return denied
        if mutating and conn.scope["type"] == "http":
            return _unsupported_body(conn)
        return None

    def _authenticate(self, conn: HTTPConnection, mutating: bool) -> Response | None:
        assert self.token is not None
        scheme, _, credentials = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            if _same(credentials.strip(), self.token):
                return None
            return _unauthorized(
                "The Bearer token is not this API's token (CKVAL_API_TOKEN on the server).",
                invalid=True,
            )
        path = conn.scope["path"]
        on_ui = path == UI_PREFIX or path.startswith(UI_PREFIX + "/")
        if "token" in conn.query_params and on_ui and conn.scope.get("method") == "GET":
            if _same(conn.query_params["token"], self.token):
                return self._cookie_redirect(conn)
            return _unauthorized("The token in the URL is not this API's token.", invalid=True)
        cookie = conn.cookies.get(TOKEN_COOKIE)
        if cookie is not None and _cookie_is_valid(cookie, self.token):
            # A WebSocket handshake passed the same-origin check, which needs an Origin
            # from a browser there: the cookie stands for the token.
            websocket = conn.scope["type"] == "websocket" and "origin" in conn.headers
            if not mutating or websocket or _cookie_may_mutate(conn):
                return None
            return _unauthorized(
                "The dashboard cookie alone does not allow changes: send the request with "
                "an X-Requested-With header or a JSON body, or with the Bearer token."
            )
        if cookie is not None:
            return _unauthorized(
                f"The dashboard cookie has expired (it lasts {TOKEN_COOKIE_MAX_AGE_S // 3600} "
                f"hours) or was issued for an older token: open {UI_PREFIX}/?token=<token> "
                "again, or send `Authorization: Bearer <token>`."
            )
        return _unauthorized(
            "This API needs `Authorization: Bearer <token>`, the token set as "
            "CKVAL_API_TOKEN on the server. In a browser, open "
            f"{UI_PREFIX}/?token=<token> once."
        )

    def _cookie_redirect(self, conn: HTTPConnection) -> Response:
        """Sets the dashboard cookie and sends the browser to the URL without the token,
        so that the token stays out of the address bar, history and Referer headers."""
        assert self.token is not None
        query = urlencode([(k, v) for k, v in conn.query_params.multi_items() if k != "token"])
        # A path, never a full URL: the redirect cannot lead off this site (the path
        # starts with UI_PREFIX, so it is not a "//host" URL either).
        location = quote(conn.scope["path"]) + (f"?{query}" if query else "")
        response = RedirectResponse(location, status_code=303)
        response.set_cookie(
            TOKEN_COOKIE,
            _dashboard_cookie(self.token, int(_now())),
            max_age=TOKEN_COOKIE_MAX_AGE_S,
            path="/",
            secure=conn.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        response.headers["Cache-Control"] = "no-store"
        response.headers["Referrer-Policy"] = "no-referrer"
        return response


def _cookie_may_mutate(conn: HTTPConnection) -> bool:
    """Whether a mutating request authenticated by the cookie alone came from our pages.

    Cookies ride along on requests that other pages make the browser send. SameSite=Strict
    stops cross-site ones, but not same-site ones (another port of this host, a sibling
    subdomain), and Origin is not sent by every client. A custom header or a JSON body
    cannot be sent cross-origin without a CORS preflight, which this API never answers
    with approval (it has no CORS middleware), so either one proves that a script of this
    origin sent the request: the dashboard's fetch() sends X-Requested-With.
    """
    return "x-requested-with" in conn.headers or _media_type(conn) == "application/json"


def _same_origin(conn: HTTPConnection, host: str) -> bool:
    """False when a browser says the request comes from another origin."""
    fetch_site = conn.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return False
    origin = conn.headers.get("origin")
    if origin is None:
        return True  # not sent by command-line clients; browsers send it on POST
    try:
        parts = urlsplit(origin)
        given_port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False  # "null": a sandboxed frame, a file:// page, a redirect chain
    default_port = 443 if parts.scheme == "https" else 80
    try:
        expected = urlsplit(f"//{host}")
        expected_port = expected.port
    except ValueError:
        return False
    # The scheme is not compared: behind a TLS-terminating proxy the page is https while
    # this server sees http; Host and port still tell the origin.
    return parts.hostname == (expected.hostname or "") and (given_port or default_port) == (
        expected_port or default_port
    )


def _media_type(conn: HTTPConnection) -> str | None:
    content_type = conn.headers.get("content-type")
    if content_type is None:
        return None
    return content_type.partition(";")[0].strip().lower()


def _unsupported_body(conn: HTTPConnection) -> Response | None:
    media_type = _media_type(conn)
    has_body = conn.headers.get("content-length", "0") != "0" or (
        "transfer-encoding" in conn.headers
    )
    if media_type == "application/json" or (media_type is None and not has_body):
        return None
    return _error(
        415,
        "UnsupportedMediaType",
        f"Content-Type {conn.headers.get('content-type')!r} is not accepted: send no body, "
        "or a JSON one with `Content-Type: application/json`.",
    )


async def _bounded_body(receive: Receive, conn: HTTPConnection) -> Receive | None:
    """A receive that hands the app the request's body, read whole here; None when it is
    over MAX_BODY_BYTES (by its Content-Length, or as it came)."""
    declared = conn.headers.get("content-length", "0")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        return None
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return receive  # the client went away: the app sees it as it would
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY_BYTES:
            return None
        more = message.get("more_body", False)
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    return replay


async def _nothing_more() -> dict:
    return {"type": "http.disconnect"}


def _too_large() -> Response:
    return _error(
        413,
        "BodyTooLarge",
        f"The request's body is over the {MAX_BODY_BYTES} bytes this API reads: send less "
        "(a re-validation's validate_config names paths, not data).",
    )


def _unauthorized(detail: str, *, invalid: bool = False) -> Response:
    challenge = _WWW_AUTHENTICATE + (', error="invalid_token"' if invalid else "")
    return _error(401, "Unauthorized", detail, headers={"WWW-Authenticate": challenge})


def _error(
    status_code: int, error: str, detail: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": error, "detail": detail}, status_code=status_code, headers=headers
    )
