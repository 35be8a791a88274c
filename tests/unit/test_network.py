"""The sockets' interface across nodes: the route to MASTER_ADDR, a given name kept, the first
node's loopback name resolved through another node, and a one-line reason when none is found."""

import socket

import pytest

from megatron_sdpo import network


def _loopback_name():
    name, how = network.route_interface("127.0.0.1")
    if name is None:
        pytest.skip(f"no interface holds 127.0.0.1 here: {how}")
    return name


def test_the_route_to_a_loopback_master_is_the_loopback_interface():
    name = _loopback_name()
    assert network._address_of(name) == "127.0.0.1"


def test_given_names_are_kept_and_none_is_guessed_without_a_master():
    env = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth1", "MASTER_ADDR": "127.0.0.1"}
    assert network.choose(env) == ["NCCL_SOCKET_IFNAME=ib0 (given)", "GLOO_SOCKET_IFNAME=eth1 (given)"]
    env = {}
    lines = network.choose(env)
    assert env == {} and all("no MASTER_ADDR" in ln for ln in lines)


def test_a_loopback_master_falls_back_to_another_node_or_says_why():
    _loopback_name()
    env = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9"}
    lines = network.choose(env)
    # On the first node its own name can resolve to 127.0.x.x: that is no interface for other nodes.
    assert "NCCL_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME=eth9 (given)" in lines
    assert "a loopback route, and no node of SDPO_NODES routes elsewhere" in lines[0]
    # Another node of the job reached by a routable address decides (a documentation address:
    # UDP connect sends nothing).
    env = {"MASTER_ADDR": "127.0.0.1", "SDPO_NODES": "127.0.0.1 192.0.2.77"}
    lines = network.choose(env)
    routed, how = network.route_interface("192.0.2.77")
    if routed is None:
        pytest.skip(f"no route off this machine: {how}")
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == routed
    assert "127.0.0.1 is a loopback address here" in lines[0]


def test_an_unresolvable_master_is_one_line():
    env = {"MASTER_ADDR": "no-such-node.invalid"}
    lines = network.choose(env)
    assert "NCCL_SOCKET_IFNAME" not in env and len(lines) == 2
    assert all("does not resolve here" in ln and "\n" not in ln for ln in lines)


def test_the_route_source_address_belongs_to_the_interface():
    try:
        target = socket.gethostbyname(socket.gethostname())
    except OSError:
        pytest.skip("this machine's name does not resolve")
    name, how = network.route_interface(target)
    assert name is not None, how
    assert network._address_of(name) == how.rsplit(" from ", 1)[1]
