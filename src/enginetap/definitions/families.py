"""Imports every family module so that their templates register (see ``base.register``)."""

from enginetap.definitions import (  # noqa: F401
    attention,
    dsa,
    gdn,
    mla,
    moe,
    norms,
    seeded,
)
