"""Builds syncd from its Settings and runs its servers: gRPC (members) on its own thread pool,
HTTP (operators, Prometheus) in uvicorn on a thread, and a reaper that expires leases.

Lifecycle: `Daemon(settings)` opens the store and builds everything; `start()` binds both ports and
returns once both serve; `stop()` ends member sessions, stops the servers and closes the store.
"""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from syncd.auth import Access
from syncd.daemon.coordinator import Coordinator
from syncd.daemon.grpc_service import SyncdServicer, build_grpc_server
from syncd.daemon.http_app import build_app
from syncd.daemon.metrics import Metrics
from syncd.daemon.registry import Limits, Registry
from syncd.daemon.settings import Settings
from syncd.daemon.store import Store
from syncd.net import HTTP_KEEP_ALIVE_S

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = Store(settings.db, settings.store_busy_timeout)
        self.metrics = Metrics()
        self.registry = Registry(
            settings.lease_seconds,
            Limits(settings.max_catalog_entries, settings.max_tensor_elements, settings.max_watch_streams),
        )
        self.coordinator = Coordinator(settings, self.registry, self.store, self.metrics)
        members = settings.expected_trainers + settings.expected_generators
        self.grpc_server, self.grpc_port, self._health = build_grpc_server(
            SyncdServicer(self.registry, self.coordinator),
            # Threads start lazily, so a generous cap costs nothing; each Watch stream holds one.
            settings.host,
            settings.grpc_port,
            max_workers=4 * members + 256,
            auth_token=settings.auth_token,
            max_message_bytes=settings.max_message_bytes,
        )
        self.metrics.insecure_no_auth.set(settings.access is Access.INSECURE_NO_AUTH)
        self.metrics.stall_timeout.set(settings.stall_timeout)
        app = build_app(self.registry, self.coordinator, self.metrics, settings.auth_token, settings.access)
        self._http = uvicorn.Server(
            uvicorn.Config(
                app,
                host=settings.host,
                port=settings.http_port,
                log_level="warning",
                access_log=False,
                timeout_keep_alive=HTTP_KEEP_ALIVE_S,
            )
        )
        self._stopping = threading.Event()
        self._stopped = False
        self._threads: list[threading.Thread] = []

    def start(self, ready_timeout: float = 30.0) -> None:
        self.grpc_server.start()
        for target, name in ((self._http.run, "http"), (self._reap, "lease-reaper")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        deadline = time.monotonic() + ready_timeout
        while not self._http.started:
            if not self._threads[0].is_alive() or time.monotonic() > deadline:
                raise OSError(f"HTTP server did not start on {self.settings.host}:{self.settings.http_port}")
            time.sleep(0.02)
        log.info(
            "syncd serving on %s: gRPC :%d, HTTP :%d, db %s, access: %s",
            self.settings.host,
            self.grpc_port,
            self.settings.http_port,
            self.settings.db,
            self.settings.access,
        )
        if self.settings.access is Access.INSECURE_NO_AUTH:
            log.warning(
                "INSECURE: --insecure-no-auth: serving on %s without a token; anyone who reaches "
                "it may trigger or abort refits, or register as a generator and be sent the weights",
                self.settings.host,
            )

    def _reap(self) -> None:
        period = min(1.0, self.settings.lease_seconds / 4)
        while not self._stopping.wait(period):
            self.registry.expire()

    def wait(self) -> None:
        self._stopping.wait()

    def request_stop(self) -> None:
        self._stopping.set()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        self._health.enter_graceful_shutdown()
        self.coordinator.shutdown()
        self.registry.close_all()
        self._http.should_exit = True
        self.grpc_server.stop(grace=1.0).wait()
        for thread in self._threads:
            thread.join(timeout=5)
        self.store.close()
        log.info("syncd stopped")
