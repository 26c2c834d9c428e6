"""Object collectives through the engine's ``_issue`` ([Note: object collectives]).

Checkpoint code agrees on outcomes with these; they must give what torch's
``all_gather_object``/``broadcast_object_list`` give, on the world group and on a
subgroup, for objects of different sizes on different ranks.
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_yafsdp.core.comm.collectives import all_gather_objects, broadcast_object
from tests.distributed import dist_run


def _exchange() -> dict:
    rank = dist.get_rank()
    mine = {"rank": rank, "text": "y" * (1000 * rank), "nested": [rank] * rank}
    upper = dist.new_group([1, 2])  # a subgroup: group ranks are not global ranks
    result = {
        "gathered": all_gather_objects(mine),
        "from_two": broadcast_object(mine if rank == 2 else None, src_rank=2),
        "nothing": all_gather_objects(None),
    }
    if rank in (1, 2):
        result["sub_gathered"] = all_gather_objects(rank * 10, group=upper)
        result["sub_from_last"] = broadcast_object(
            "from 2" if rank == 2 else None, src_rank=1, group=upper
        )
    return result


def test_objects_are_gathered_and_broadcast_as_torch_does_on_world_and_subgroups() -> None:
    results = dist_run(3, _exchange)
    expected = [{"rank": r, "text": "y" * (1000 * r), "nested": [r] * r} for r in range(3)]
    for rank, result in enumerate(results):
        assert result["gathered"] == expected
        assert result["from_two"] == expected[2]
        assert result["nothing"] == [None, None, None]
        if rank in (1, 2):
            assert result["sub_gathered"] == [10, 20]
            assert result["sub_from_last"] == "from 2"
