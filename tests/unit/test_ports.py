"""Ports for child servers come from below the kernel's ephemeral range, so an outgoing
connection cannot take one between its choice and the child's bind."""

from __future__ import annotations

import socket

from scalerl import ports


def test_a_free_port_lies_below_the_ephemeral_range(tmp_path, monkeypatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    chosen = {ports.free_port() for _ in range(50)}
    assert all(10_000 <= port < 32768 for port in chosen) and len(chosen) > 40
    with socket.socket() as sock:  # and it is free: a server can bind it
        sock.bind(("127.0.0.1", chosen.pop()))


def test_without_room_below_the_range_any_free_port_is_taken(tmp_path, monkeypatch) -> None:
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("10500 60999\n")  # fewer than 1,000 ports below: not used
    monkeypatch.setattr(ports, "_RANGE_FILE", range_file)
    assert ports._below_ephemeral() == (0, 0)
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert 0 < ports.free_port() < 65536
