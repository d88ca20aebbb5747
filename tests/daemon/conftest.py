"""Fixtures of the daemon and CLI tests (the helpers live in ``daemon_support``).

Test modules import helpers from ``daemon_support``, never from ``conftest``:
several test folders have a ``conftest.py``, and which one a bare
``import conftest`` finds depends on collection order.
"""

from daemon_support import notify_socket, small_tmpfs, start_daemon

__all__ = ["notify_socket", "small_tmpfs", "start_daemon"]
