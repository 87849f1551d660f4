"""Authentication by bearer token and RBAC authorisation over the Role/Binding objects in the store.

Users come from the fake's token table (static tokens, and ServiceAccount tokens minted by
TokenRequest). ``system:masters`` may do anything. Everyone authenticated gets the built-in
``system:basic-user`` and ``system:discovery`` rules (self reviews, discovery URLs). Everything else
comes from ClusterRoleBindings (cluster-wide) and RoleBindings (their namespace), as kube-apiserver's
RBAC authorizer evaluates them; ``resourceNames`` and ``*`` wildcards are honoured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tests.kubefake.store import Store

BASIC_USER_RULES = [
    {
        "verbs": ["create"],
        "apiGroups": ["authorization.k8s.io"],
        "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
    },
    {"verbs": ["create"], "apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"]},
]
NON_RESOURCE_RULES = [
    {"verbs": ["get"], "nonResourceURLs": ["/healthz", "/livez", "/readyz", "/version", "/version/"]},
    {
        "verbs": ["get"],
        "nonResourceURLs": [
            "/api",
            "/api/*",
            "/apis",
            "/apis/*",
            "/healthz",
            "/livez",
            "/openapi",
            "/openapi/*",
            "/readyz",
            "/version",
            "/version/",
        ],
    },
]


@dataclass(frozen=True)
class User:
    """An authenticated identity, as SelfSubjectReview shows it."""

    name: str
    groups: tuple[str, ...] = ("system:authenticated",)
    uid: str = ""
    extra: dict[str, list[str]] = field(default_factory=dict, hash=False, compare=False)

    def info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"username": self.name}
        if self.uid:
            info["uid"] = self.uid
        info["groups"] = list(self.groups)
        if self.extra:
            info["extra"] = self.extra
        return info


@dataclass(frozen=True)
class Attributes:
    """What a request asks to do (the authorizer's view of it)."""

    verb: str
    group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    path: str = ""

    @property
    def is_resource(self) -> bool:
        return bool(self.resource)


def _subject_matches(subject: dict[str, Any], user: User) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user.name
    if kind == "Group":
        return subject.get("name") in user.groups
    if kind == "ServiceAccount":
        return user.name == f"system:serviceaccount:{subject.get('namespace')}:{subject.get('name')}"
    return False


def _rule_allows(rule: dict[str, Any], attributes: Attributes) -> bool:
    verbs = rule.get("verbs") or []
    if "*" not in verbs and attributes.verb not in verbs:
        return False
    if not attributes.is_resource:
        urls = rule.get("nonResourceURLs") or []
        return any(
            u == "*" or u == attributes.path or (u.endswith("*") and attributes.path.startswith(u[:-1]))
            for u in urls
        )
    groups = rule.get("apiGroups") or []
    if "*" not in groups and attributes.group not in groups:
        return False
    wanted = attributes.resource + (f"/{attributes.subresource}" if attributes.subresource else "")
    resources = rule.get("resources") or []
    if not any(
        r in ("*", wanted) or (r == f"*/{attributes.subresource}" and attributes.subresource)
        for r in resources
    ):
        return False
    names = rule.get("resourceNames") or []
    return not names or attributes.name in names


class Authorizer:
    """RBAC over the store's roles and bindings, read at every request (so POSTed roles apply at once)."""

    def __init__(self, store: Store):
        self.store = store

    def rules(self, user: User, namespace: str) -> list[tuple[str, dict[str, Any]]]:
        """(why, rule) for every rule that applies to ``user`` in ``namespace`` ('' = cluster scope)."""
        found: list[tuple[str, dict[str, Any]]] = []
        for _, binding in self.store.items("clusterrolebindings"):
            if any(_subject_matches(s, user) for s in binding.obj.get("subjects") or []):
                role = self.store.get("clusterroles", binding.obj.get("roleRef", {}).get("name", ""))
                why = (
                    f'RBAC: allowed by ClusterRoleBinding "{binding.obj["metadata"]["name"]}" of ClusterRole '
                    f'"{binding.obj.get("roleRef", {}).get("name")}" to User "{user.name}"'
                )
                found += [(why, rule) for rule in (role.obj.get("rules") or [] if role else [])]
        found += [
            (
                'RBAC: allowed by ClusterRoleBinding "system:basic-user" of ClusterRole "system:basic-user" '
                'to Group "system:authenticated"',
                rule,
            )
            for rule in BASIC_USER_RULES
        ]
        if namespace:
            for _, binding in self.store.items("rolebindings", namespace):
                if any(_subject_matches(s, user) for s in binding.obj.get("subjects") or []):
                    ref = binding.obj.get("roleRef", {})
                    plural = "clusterroles" if ref.get("kind") == "ClusterRole" else "roles"
                    key = (
                        ref.get("name", "")
                        if plural == "clusterroles"
                        else f"{namespace}/{ref.get('name', '')}"
                    )
                    role = self.store.get(plural, key)
                    why = (
                        f'RBAC: allowed by RoleBinding "{binding.obj["metadata"]["name"]}/{namespace}" of '
                        f'{ref.get("kind")} "{ref.get("name")}" to User "{user.name}"'
                    )
                    found += [(why, rule) for rule in (role.obj.get("rules") or [] if role else [])]
        return found

    def allowed(self, user: User, attributes: Attributes) -> tuple[bool, str]:
        """(allowed, reason) as SubjectAccessReview reports it."""
        if "system:masters" in user.groups:
            return True, ""
        if not attributes.is_resource:
            if any(_rule_allows(rule, attributes) for rule in NON_RESOURCE_RULES):
                return True, 'RBAC: allowed by ClusterRoleBinding "system:discovery"'
            return False, ""
        for why, rule in self.rules(user, attributes.namespace):
            if _rule_allows(rule, attributes):
                return True, why
        return False, ""

    def rules_review(self, user: User, namespace: str) -> dict[str, Any]:
        """The status of a SelfSubjectRulesReview (083)."""
        if "system:masters" in user.groups:
            resource_rules = [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"]}] + [
                _rule_view(r) for r in BASIC_USER_RULES
            ]
            non_resource = [{"verbs": ["*"], "nonResourceURLs": ["*"]}, *NON_RESOURCE_RULES]
        else:
            resource_rules = [_rule_view(rule) for _, rule in self.rules(user, namespace)]
            non_resource = NON_RESOURCE_RULES
        return {"resourceRules": resource_rules, "nonResourceRules": non_resource, "incomplete": False}


def _rule_view(rule: dict[str, Any]) -> dict[str, Any]:
    view = {
        "verbs": rule.get("verbs") or [],
        "apiGroups": rule.get("apiGroups") or [],
        "resources": rule.get("resources") or [],
    }
    if rule.get("resourceNames"):
        view["resourceNames"] = rule["resourceNames"]
    return view
