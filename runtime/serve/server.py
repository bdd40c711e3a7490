"""Run the server: uvicorn on a thread of its own, the scheduler on the calling thread (the model's)."""

from __future__ import annotations

import socket
import sys
import threading
import time

import uvicorn

from runtime.serve.scheduler import Scheduler

SHUTDOWN_GRACE_S = 5  # after Ctrl-C / SIGTERM, open responses get this long to send their error and close
STARTUP_WAIT_S = 10.0  # uvicorn must be serving within this long


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: any free one); a ValueError naming the fix if it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port (or --host)") from None


def start_http(app, sock: socket.socket) -> tuple[uvicorn.Server, threading.Thread]:
    """uvicorn serving `app` on `sock` from a daemon thread, started: (server, thread)."""
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="specvocab-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_WAIT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start (see the log above)")
        time.sleep(0.01)
    return server, thread


def serve(scheduler: Scheduler, app, sock: socket.socket, banner: str) -> None:
    """Serve until Ctrl-C or SIGTERM (raised here as KeyboardInterrupt): requests still open get a 503
    error, new connections are refused, and uvicorn closes within SHUTDOWN_GRACE_S."""
    server, thread = start_http(app, sock)
    print(banner, file=sys.stderr, flush=True)
    try:
        scheduler.run(keep_going=thread.is_alive)
    finally:
        server.should_exit = True
        thread.join(SHUTDOWN_GRACE_S + 1)
