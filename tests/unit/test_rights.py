"""Roles' rights, pure: the most specific prefix decides, a deny of the same length wins,
and the cluster's own pairs hold every right."""
from __future__ import annotations

import pytest

from clonemap.shards.common.config import SecurityConfig
from clonemap.shards.common.rights import EVERY_RIGHT, OPEN, Rights


def test_the_most_specific_prefix_decides_and_a_deny_of_the_same_length_wins():
    r = Rights(read=("/", "/secrets/public/"), write=("/orders/",),
               deny=("/secrets/", "/orders/"))
    assert r.may_read("/config/a") and not r.may_read("/secrets/key")
    assert r.may_read("/secrets/public/motd")  # longer than the deny
    assert not r.may_read("config")             # "/" does not start it
    assert not r.may_write("/orders/1")         # the deny is as specific: it wins
    assert not r.may_write("/config/a")         # no grant at all
    assert Rights(read=("",)).may_read("anything") and not Rights().may_read("")


def test_describe_says_every_right_in_one_line():
    assert Rights(read=("/",), deny=("/s/",)).describe() == "read /; deny /s/"
    assert EVERY_RIGHT.describe() == "read (every key); write (every key); admin"
    assert Rights().describe() == "nothing"


def test_access_by_user_id():
    security = SecurityConfig(curve=True, clients={"dash": {"role": "reader"},
                                                   "ops": {"role": "admin"}},
                              roles={"reader": {"read": ["/"]},
                                     "admin": {"admin": True}})
    access = security.access()
    assert access.rights_of("dash") == Rights(read=("/",))
    assert [access.may_admin(u) for u in ("dash", "ops", "server", "client", None,
                                          "stranger")] == [False, True, True, True, True,
                                                           False]
    assert access.describe()["dash"]["role"] == "reader"
    assert OPEN.may_admin("client") and not OPEN.may_admin("someone")


@pytest.mark.parametrize("given, field", [
    ({"curve": False, "clients": {"a": {"role": "r"}}, "roles": {"r": {}}},
     "security.clients: given"),
    ({"curve": True, "clients": {"server": {"role": "r"}}, "roles": {"r": {}}},
     "security.clients.server: given"),
    ({"curve": True, "clients": {"a b": {"role": "r"}}, "roles": {"r": {}}},
     "security.clients.a b: given"),
    ({"curve": True, "clients": {"a": {"role": "nope"}}, "roles": {"r": {}}},
     "security.clients.a.role: given \"nope\": no such role in security.roles (roles: r)"),
    ({"curve": True, "roles": {"r": {"read": ["/"], "admn": True}}}, "admn"),
])
def test_a_bad_identity_or_role_is_refused_naming_the_field(given, field):
    with pytest.raises(ValueError) as exc:
        SecurityConfig(**given)
    assert field in str(exc.value)
