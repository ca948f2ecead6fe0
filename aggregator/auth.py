"""Who may call which aggregator route: credentials, roles, and the middleware that enforces them.

It reads bearer credentials (node tokens derived from the site secret, Kubernetes projected tokens through
aggregator/tokenreview.py, one token file per other role) and checks them against one explicit table of
(method, route) to role; every refusal is a 401/403 with a JSON reason, counted by door and reason. It
validates no request body and decides nothing else (README.md, "Roles"; docs/kubernetes.md, "Node
credentials").
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from pydantic import Field, model_validator

from vigil.aggregator.tokenreview import REVIEW_REASONS, KubernetesAuthConfig, TokenReviewer
from vigil.contract.credential_file import exposure
from vigil.contract.validation import ConfigError, StrictModel
from vigil.contract.wire import check_node_name


class Role(Enum):
    PUBLIC = "public"
    NODE = "node"
    ALERTMANAGER = "alertmanager"
    OPERATOR = "operator"
    READ = "read"


# THE table: (method, canonical route) -> role. A POST (or any other changing method) that is
# not listed here needs the operator role; a GET not listed needs the read role. Operator
# routes added later (resume, hold, breaker reset) need no entry to be protected.
ROUTE_ROLES: dict[tuple[str, str], Role] = {
    ("POST", "/v1/reports"): Role.NODE,
    ("POST", "/v1/alertmanager"): Role.ALERTMANAGER,
    ("POST", "/v1/breaker/reset"): Role.OPERATOR,
    ("POST", "/v1/nodes/{node}/hold"): Role.OPERATOR,
    ("POST", "/v1/nodes/{node}/resume"): Role.OPERATOR,
    ("GET", "/v1/nodes"): Role.READ,
    ("GET", "/v1/nodes/{node}"): Role.READ,
    ("GET", "/v1/decisions"): Role.READ,
    ("GET", "/v1/breaker"): Role.READ,
    ("GET", "/v1/gate"): Role.READ,
    ("GET", "/healthz"): Role.PUBLIC,
    ("GET", "/metrics"): Role.PUBLIC,
}
_READING_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# The door a refusal is counted under (vigil_aggregator_refusals_total{door, reason}).
DOORS = ("reports", "alertmanager", "operator", "read", "connections")
DOOR_OF_ROLE = {Role.NODE: "reports", Role.ALERTMANAGER: "alertmanager", Role.OPERATOR: "operator",
                Role.READ: "read"}
NODE_KEY = web.RequestKey("authenticated_node", str)  # the node a node token speaks for
TOKEN_SEPARATOR = "~"  # never in a node name, allowed in an RFC 6750 bearer token
MIN_SECRET_CHARS = 32
# The AuthConfig keys naming credential files (checked for exposure at start).
CREDENTIAL_FILE_KEYS = ("site_secret_file", "alertmanager_token_file", "operator_token_file", "read_token_file")


def role_for(method: str, route: str) -> Role:
    method = "GET" if method in _READING_METHODS else method
    role = ROUTE_ROLES.get((method, route))
    if role is not None:
        return role
    return Role.READ if method == "GET" else Role.OPERATOR


class AuthConfig(StrictModel):
    """Credential files, one per role. A role with no credential is closed, except: reads on a
    loopback listener, and every role on a loopback listener in dry run (the no-config demo)."""

    # Node tokens are derived from this secret and the node's name (``vigil token create``).
    site_secret_file: str | None = None
    alertmanager_token_file: str | None = None
    operator_token_file: str | None = None
    # The operator token is also accepted for reads. Without a read token, reads on a loopback
    # listener are open; beyond loopback they need this or the operator token.
    read_token_file: str | None = None
    # Node credentials on Kubernetes: the agent pod's projected service-account token, verified
    # by the API server (TokenReview) and bound to the pod's node (docs/kubernetes.md). Node
    # tokens from site_secret_file are still accepted beside it.
    kubernetes: KubernetesAuthConfig = Field(default_factory=KubernetesAuthConfig)


class TlsConfig(StrictModel):
    """Serve https with this certificate chain and key (PEM files); both or neither."""

    cert_file: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _both(self) -> TlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


def read_secret(path: str, what: str, min_chars: int = 16) -> bytes:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    if len(value) < min_chars:
        raise ConfigError(f"{what} file {path} holds {len(value)} characters; at least {min_chars} are needed")
    return value.encode()


def node_token(site_secret: bytes, node: str) -> str:
    """The bearer token of ``node``: its name and HMAC-SHA256(site secret, name) in hex."""
    check_node_name(node)
    return f"{node}{TOKEN_SEPARATOR}{hmac.new(site_secret, node.encode(), hashlib.sha256).hexdigest()}"


def new_secret() -> str:
    """A fresh site secret or role token: 256 random bits, hex."""
    return secrets.token_hex(32)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Node tokens verified, kept so that a node's every report does not recompute its HMAC (a third
# of the intake check's cost): above any fleet, and emptied when full (each node then verifies
# once more).
MAX_VERIFIED_TOKENS = 1 << 17


@dataclass(frozen=True)
class Credentials:
    site_secret: bytes | None = None
    alertmanager: bytes | None = None
    operator: bytes | None = None
    read: bytes | None = None
    kubernetes: TokenReviewer | None = None
    # token -> the node it verified for. Only tokens that verified are kept, so a stream of forged
    # ones cannot fill it; a hit answers only for the exact bytes of a token that was valid. A new
    # site secret means new Credentials, and so an empty table.
    _verified: dict[bytes, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def load(cls, config: AuthConfig) -> Credentials:
        """Read the credential files; one that other users may read (or its group change) is
        refused, as ssh refuses such a key: with it anyone on this host could act as every node,
        as Alertmanager or as an operator."""
        for key in CREDENTIAL_FILE_KEYS:
            path = getattr(config, key)
            problem = exposure(path) if path else None
            if problem is not None:
                raise ConfigError(f"auth.{key}: {problem}; refused")

        def token(key: str, what: str, min_chars: int = 16) -> bytes | None:
            path = getattr(config, key)
            try:
                return read_secret(path, what, min_chars) if path else None
            except ConfigError as exc:  # the key path first, as every config error names it
                raise ConfigError(f"auth.{key}: {exc}") from None

        return cls(
            site_secret=token("site_secret_file", "site secret", MIN_SECRET_CHARS),
            alertmanager=token("alertmanager_token_file", "alertmanager token"),
            operator=token("operator_token_file", "operator token"),
            read=token("read_token_file", "read token"),
            kubernetes=TokenReviewer(config.kubernetes) if config.kubernetes.enabled else None,
        )

    async def close(self, _app: object = None) -> None:
        """Close the TokenReview client (an aiohttp on_cleanup callback, hence the argument)."""
        if self.kubernetes is not None:
            await self.kubernetes.close()

    @property
    def any(self) -> bool:
        return any((self.site_secret, self.alertmanager, self.operator, self.read, self.kubernetes))

    def configured(self, role: Role) -> bool:
        if role is Role.NODE:
            return self.site_secret is not None or self.kubernetes is not None
        return getattr(self, role.value) is not None

    def roles_of(self, token: bytes) -> tuple[set[Role], str | None]:
        """The roles ``token`` carries, and the node it speaks for (node tokens). Every
        configured credential is compared, in constant time, whatever matches first."""
        roles: set[Role] = set()
        node = None
        for role, expected in ((Role.ALERTMANAGER, self.alertmanager), (Role.OPERATOR, self.operator),
                               (Role.READ, self.read)):
            if expected is not None and hmac.compare_digest(token, expected):
                roles.add(role)
        if Role.OPERATOR in roles:
            roles.add(Role.READ)
        if self.site_secret is not None:
            node = self._verified.get(token)
            if node is None:
                name, sep, _ = token.decode(errors="replace").partition(TOKEN_SEPARATOR)
                try:
                    expected = node_token(self.site_secret, name).encode() if sep else b""
                except ValueError:
                    expected = b""
                if hmac.compare_digest(token, expected) and expected:
                    node = name
                    if len(self._verified) >= MAX_VERIFIED_TOKENS:
                        self._verified.clear()
                    self._verified[token] = name
            if node is not None:
                roles.add(Role.NODE)
        return roles, node


class Refusals:
    """``vigil_aggregator_refusals_total{door, reason}``: every request, alert or connection
    refused at any door. The series of the auth reasons exist at 0 from the start."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry  # where a TokenReviewer's own counts are registered
        self.counter = Counter("vigil_aggregator_refusals", "Requests, alerts and connections refused, by door "
                               "and reason.", ["door", "reason"], registry=registry)
        for door in DOORS[:4]:
            for reason in ("unauthenticated", "bad_credential", "forbidden"):
                self.counter.labels(door, reason)
        for reason in (*REVIEW_REASONS, "node_mismatch"):
            self.counter.labels("reports", reason)

    def count(self, door: str, reason: str, n: int = 1) -> None:
        self.counter.labels(door, reason).inc(n)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def refusal(status: int, reason: str, detail: str) -> web.Response:
    return web.json_response({"error": reason, "detail": detail}, status=status)


def auth_middleware(credentials: Credentials, refusals: Refusals, *, loopback: bool, dry_run: bool,
                    on_report_refusal: Callable[[str], None] | None = None
                    ) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The aiohttp middleware enforcing ``ROUTE_ROLES``. ``on_report_refusal`` also counts a
    refused report in the report door's own family (vigil_aggregator_report_rejections_total)."""

    def refuse(role: Role, status: int, reason: str, detail: str) -> web.Response:
        refusals.count(DOOR_OF_ROLE[role], reason)
        if role is Role.NODE and on_report_refusal is not None:
            on_report_refusal(reason)
        return refusal(status, reason, detail)

    reviewer = credentials.kubernetes
    if reviewer is not None:
        refusals.registry.register(reviewer.collector())

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is None:  # no such route: aiohttp's own 404/405
            return await handler(request)
        role = role_for(request.method, resource.canonical)
        if role is Role.PUBLIC:
            return await handler(request)
        configured = credentials.configured(role)
        if not configured and loopback and (role is Role.READ or dry_run):
            return await handler(request)
        if not configured and not (role is Role.READ and credentials.operator is not None):
            return refuse(role, 403, "role_not_configured",
                          f"no {role.value} credential is configured on this aggregator, so this route is closed")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return refuse(role, 401, "unauthenticated", f"this route needs a {role.value} bearer token")
        token = given.strip().encode()
        roles, node = credentials.roles_of(token)
        if not roles and role is Role.NODE and reviewer is not None:
            # Not a node token: the agent pod's service-account token? (only at the reports door)
            verdict = await reviewer.review(token)
            if verdict.node is None:
                return refuse(role, verdict.status, verdict.reason, verdict.detail)
            roles, node = {Role.NODE}, verdict.node
        if not roles:
            return refuse(role, 401, "bad_credential", "the bearer token is not valid here")
        if role not in roles:
            return refuse(role, 403, "forbidden",
                          f"this route needs the {role.value} role; the token carries "
                          f"{', '.join(sorted(r.value for r in roles))}")
        if node is not None and role is Role.NODE:
            request[NODE_KEY] = node
        return await handler(request)

    return middleware
