"""The domain enums and their proto twins: one checked table in convert.py."""

from __future__ import annotations

import enum

import pytest
from ferrum_client import pb
from ferrum_client.scheduler import ItemKind as ClientItemKind
from ferrum_client.scheduler import ItemStatus as ClientItemStatus
from ferrum_server import convert
from ferrum_server.domain import CapacityUnit, DeferralStage, ItemStatus, ShortfallKind


def test_a_drifted_member_is_refused_at_import() -> None:
    class Drifted(enum.IntEnum):
        BLOCKS = 1
        SEQUENCES = 3  # the proto says 2

    with pytest.raises(ImportError, match="CAPACITY_UNIT_SEQUENCES = 2"):
        convert._check_twins(Drifted, pb.CapacityUnit, "CAPACITY_UNIT_")


def test_a_member_without_a_twin_is_refused() -> None:
    class Invented(enum.IntEnum):
        SOMETHING_NEW = 9

    with pytest.raises(ImportError, match="SHORTFALL_KIND_SOMETHING_NEW = None"):
        convert._check_twins(Invented, pb.ShortfallKind, "SHORTFALL_KIND_")


@pytest.mark.parametrize(
    ("domain", "proto", "prefix"),
    [
        (DeferralStage, pb.ExecutionCapacityStage, "EXECUTION_CAPACITY_STAGE_"),
        (ShortfallKind, pb.ShortfallKind, "SHORTFALL_KIND_"),
        (CapacityUnit, pb.CapacityUnit, "CAPACITY_UNIT_"),
        (ItemStatus, pb.ItemStatus, "ITEM_STATUS_"),
        (ClientItemStatus, pb.ItemStatus, "ITEM_STATUS_"),
        (ClientItemKind, pb.ItemKind, "ITEM_KIND_"),
    ],
)
def test_every_member_casts_to_its_proto_name(
    domain: type[enum.IntEnum], proto: pb.ItemStatus, prefix: str
) -> None:
    for member in domain:
        assert proto.Name(member.value) == prefix + member.name  # type: ignore[arg-type]
