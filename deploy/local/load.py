"""The demo's background load (`--load N`): N clients, each sending long greedy completions back to
back while the trainer trains and syncd refits, as rollouts of async RL do.

Every answer is checked the way a trainer would use it: it must be a 200 whose every choice says
which weight versions produced its tokens (`weight_versions`, generator_svc/README.md "Weight
versions of every completion"). What the clients saw: `LoadResult`.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

import httpx

log = logging.getLogger("demo.load")


@dataclass
class LoadResult:
    requests: int = 0
    failed_requests: int = 0  # not a 200 (or no answer at all)
    responses_without_versions: int = 0  # a 200 with a choice that has no weight_versions
    spanning: Counter[str] = field(default_factory=Counter)  # version -> answers that switched to it
    errors: list[str] = field(default_factory=list)  # the first few failures, for the log


class Load:
    """`clients` threads against the generator at `url`, each cycling through `prompts` (from its
    own offset) with `max_tokens` greedy tokens per request, until `stop`."""

    def __init__(self, url: str, prompts: list[list[int]], clients: int, max_tokens: int) -> None:
        self._url = url
        self._prompts = prompts
        self._max_tokens = max_tokens
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.result = LoadResult()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> LoadResult:
        """Let every client finish its request in flight, then return what they saw."""
        self._stopping.set()
        for t in self._threads:
            t.join(300)
        return self.result

    def _client(self, offset: int) -> None:
        with httpx.Client(base_url=self._url, timeout=300) as http:
            i = offset
            while not self._stopping.is_set():
                prompt = self._prompts[i % len(self._prompts)]
                i += 1
                try:
                    r = http.post("/v1/completions", json=self._body(prompt))
                except httpx.HTTPError as e:
                    self._record_failure(f"{type(e).__name__}: {e}")
                    continue
                if r.status_code != 200:
                    self._record_failure(f"{r.status_code} {r.text[:200]}")
                    continue
                self._record(r.json()["choices"])

    def _body(self, prompt: list[int]) -> dict:
        return {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": self._max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "detokenize": False,
        }

    def _record(self, choices: list[dict]) -> None:
        with self._lock:
            self.result.requests += 1
            spans = [c.get("weight_versions") for c in choices]
            complete = [s for s in spans if s is not None]
            if len(complete) < len(spans):
                self.result.responses_without_versions += 1
                return
            for choice_spans in complete:
                for switch in choice_spans[1:]:
                    self.result.spanning[switch["version"]] += 1

    def _record_failure(self, error: str) -> None:
        with self._lock:
            self.result.requests += 1
            self.result.failed_requests += 1
            if len(self.result.errors) < 5:
                self.result.errors.append(error)
                log.warning("load: a request failed: %s", error)
