"""Ports for the tests' rendezvous: one the OS says is free now (a test's torchrun or gloo group binds it next)."""

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the moment of asking."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
