"""Store options of `oasiskv serve`: the TTL reaches the stores, and the decode workers' refresh
of what they hold follows it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from oasiskv.cluster.config import ServeConfig
from oasiskv.cluster.launcher import store_config
from oasiskv.kvstore import KVStoreServer, connect

from .test_decode_options import _config  # `oasiskv serve`'s arguments as its config


def test_the_default_ttl_keeps_the_default_refresh():
    config = _config()
    assert config.store_ttl_s == 600.0
    assert config.decode.store_keep_alive_s == 30.0


def test_a_short_ttl_makes_the_decode_workers_refresh_sooner():
    config = _config("--store-ttl-s", "40")
    assert config.decode.store_keep_alive_s == 10.0
    assert config.decode.mode == "lookahead"  # the rest of the decode options stay as given


def test_a_refresh_set_apart_from_the_ttl_must_fit_twice_into_it():
    assert ServeConfig(store_ttl_s=60, decode={"store_keep_alive_s": 30}).decode.store_keep_alive_s == 30
    with pytest.raises(ValidationError, match=r"store_keep_alive_s \(31 s\) must be at most half of store_ttl_s \(60 s\)"):
        ServeConfig(store_ttl_s=60, decode={"store_keep_alive_s": 31})


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_ttl_that_is_not_positive_is_refused(value):
    with pytest.raises(ValidationError, match="store_ttl_s"):
        _config("--store-ttl-s", value)


def test_fetch_timeout_reaches_the_decode_config():
    assert _config().decode.fetch_timeout_s == 30.0
    assert _config("--fetch-timeout-s", "5").decode.fetch_timeout_s == 5.0
    with pytest.raises(ValidationError, match="fetch_timeout_s"):
        _config("--fetch-timeout-s", "0")


def test_the_launched_store_frees_on_the_configured_ttl():
    fields = store_config(_config("--store-ttl-s", "45", "--transport", "tcp"), 0)
    assert fields["ttl_s"] == 45.0 and fields["transport"] == "tcp"
    server = KVStoreServer(**fields, prefault=False)
    server.start()
    try:
        client = connect(server.address, transport="tcp", timeout=10)
        try:
            assert client.transport.hello["ttl_s"] == 45.0  # what the store tells each client it frees after
        finally:
            client.close()
    finally:
        server.stop()


def test_each_store_gets_its_own_port_after_the_first():
    config = _config("--store-port", "7400", "--stores", "3")
    assert [store_config(config, i)["port"] for i in range(3)] == [7400, 7401, 7402]
    assert store_config(_config(), 1)["port"] == 0  # any free port


def test_a_misspelt_serve_option_is_refused():
    """ServeConfig and its DecodeConfig took unknown fields and ran with the defaults."""
    with pytest.raises(ValueError, match="store_capacity_gbb"):
        ServeConfig(store_capacity_gbb=4)
    with pytest.raises(ValueError, match="budget_token"):
        ServeConfig(decode={"budget_token": 64})
