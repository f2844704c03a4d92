"""Fleets that share one Redis stay apart (``--output-rate-store-fleet`` or the
URL's ``fleet``): every key and channel a fleet uses carries its name
(``store.redis_store.KeySpace.of_fleet``), a store without a fleet keeps the
keys it always had, and two fleets' engines on one real ``redis-server``
(the store's real runtime, one with a control plane on real gRPC) share
neither user cells, nor the limits table and its kill switch, nor the
live-engine set."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.cluster import key_slot

from control.service.operations import LimitsService
from pacing.modes import Mode
from pacing.settings.store import FLEET_FLAG, STORE_FLAG, StoreSettings
from protos.outputrate.v1 import output_rate_pb2 as pb
from store.clients import connect
from store.limits_table import encode
from store.redis_store import KeySpace, RedisStore
from store.runtime import RunningStore, attach
from tests.control_harness import Rig, Served, make_rig, serving

#: How long a change may take to reach an engine on this shared machine.
EVENTUALLY_S = 10.0


def names_of(keys: KeySpace) -> dict[str, str]:
    """Every key and channel ``keys`` makes, by member name (found by
    introspection: a key added later is checked too)."""
    made: dict[str, str] = {}
    for name, member in inspect.getmembers(type(keys)):
        if name.startswith("_") or name in ("prefix", "of_fleet"):
            continue
        if isinstance(member, property):
            made[name] = getattr(keys, name)
        elif inspect.isfunction(member):
            made[name] = getattr(keys, name)("alice")
    return made


def test_a_store_without_a_fleet_keeps_its_keys() -> None:
    assert KeySpace.of_fleet(None) == KeySpace()
    assert names_of(KeySpace.of_fleet(None)) == {
        "cell": "output_rate:user:{alice}",
        "limits": "{output_rate}:limits",
        "engines": "{output_rate}:engines",
        "limits_channel": "output_rate:limits",
    }


@pytest.mark.parametrize("fleet", ["a", "blue-1", "x.y_Z", "f" * 64])
def test_every_key_and_channel_of_a_fleet_starts_with_its_prefix(fleet: str) -> None:
    keys = KeySpace.of_fleet(fleet)
    assert keys.prefix == f"output_rate:{fleet}"
    for name, key in names_of(keys).items():
        assert key.startswith((f"{keys.prefix}:", f"{{{keys.prefix}}}:")), name


def test_fleets_share_no_key_and_keep_their_cluster_slots() -> None:
    spaces = [KeySpace.of_fleet(fleet) for fleet in (None, "a", "b", "user", "limits")]
    made = [set(names_of(keys).values()) for keys in spaces]
    assert sum(map(len, made)) == len(set().union(*made))
    for keys in spaces:  # one slot for the table and the engines, the user's for a cell
        assert key_slot(keys.limits.encode()) == key_slot(keys.engines.encode())
        assert key_slot(keys.cell("alice").encode()) == key_slot(b"alice")


@pytest.mark.parametrize("fleet", ["", "a:b", "a{b}", "a b", "é", "f" * 65])
def test_a_bad_fleet_name_is_refused_naming_the_flag(fleet: str) -> None:
    with pytest.raises(ValueError, match=f"^{FLEET_FLAG} must be 1 to 64"):
        StoreSettings("redis://127.0.0.1:6379/0", fleet=fleet)
    in_url = f"^{STORE_FLAG}(: option 'fleet' needs one value| option fleet must be)"
    with pytest.raises(ValueError, match=in_url):
        StoreSettings(f"redis://127.0.0.1:6379/0?fleet={fleet}")


def test_a_fleet_in_the_url_and_another_in_the_flag_is_refused() -> None:
    assert StoreSettings("redis://h/0?fleet=a").fleet == "a"
    assert StoreSettings("redis://h/0?fleet=a", fleet="a").fleet == "a"
    with pytest.raises(ValueError, match="differ"):
        StoreSettings("redis://h/0?fleet=a", fleet="b")


@contextlib.contextmanager
def engine(settings: StoreSettings) -> Iterator[tuple[Rig, RunningStore, Served]]:
    """One engine's store runtime with its control plane on real gRPC."""
    rig = make_rig(default_rate=10)
    running = attach(rig.shared, settings)
    try:
        with serving(LimitsService(rig.shared, global_store=True)) as served:
            yield rig, running, served
    finally:
        running.stop()


def table_of(store: RedisStore) -> tuple[object, str]:
    """The stored limits table's version and document."""
    read = store.read_limits()
    assert read is not None
    return read[0], encode(read[1])


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + EVENTUALLY_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {EVENTUALLY_S} s"
        time.sleep(0.01)


def test_two_fleets_on_one_redis_share_no_cell_table_kill_switch_or_engines(
    redis_url: str,
) -> None:
    client = connect(redis_url, timeout_s=5.0)
    assert isinstance(client, redis.Redis)
    client.flushdb()
    a, b = KeySpace.of_fleet("a"), KeySpace.of_fleet("b")
    with contextlib.ExitStack() as stack:
        a1, a2 = (
            stack.enter_context(engine(StoreSettings(redis_url, fleet="a")))
            for _ in range(2)
        )
        b1 = stack.enter_context(engine(StoreSettings(f"{redis_url}?fleet=b")))
        stores = {name: RedisStore(client, keys=k) for name, k in (("a", a), ("b", b))}
        wait_for(lambda: all(s.read_limits() is not None for s in stores.values()))
        wait_for(lambda: client.zcard(a.engines) == 2 and client.zcard(b.engines) == 1)
        b_table = table_of(stores["b"])

        # Fleet a's kill switch, through its control plane's write path.
        a1[2].stub.UpdatePacingMode(
            pb.UpdatePacingModeRequest(
                pacing_mode=pb.PacingMode(mode=pb.PacingMode.OFF)
            )
        )
        wait_for(lambda: a2[0].shared.mode is Mode.OFF)
        assert b1[0].shared.mode is Mode.ENFORCE
        assert table_of(stores["b"]) == b_table

        # One user's cell in each: draining fleet a's leaves fleet b's whole.
        burst = a1[1].store.claim("alice", 1000, 10).granted
        assert burst > 0
        assert a2[1].store.claim("alice", 1000, 10).granted == 0
        assert b1[1].store.claim("alice", 1000, 10).granted == burst

    default = KeySpace()
    assert not client.exists(default.limits, default.engines, default.cell("alice"))
    client.close()
