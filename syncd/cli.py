"""syncctl: the operator's command line for syncd's HTTP API.

    syncctl --url http://syncd:8470 status
    syncctl members | plan [--json] | history | abort refit-3
    syncctl --token-file F refit --wait     # exit 0 only when the refit COMMITTED (or --token T)
    syncctl watch [refit-3] [--json]        # follow a refit (default: the running one) live
    syncctl verify --generator http://gen-0:8000   # exit 0 only when it holds what was sent

Tables by default, `--json` for scripts (`watch --json`: one JSON object per update). Exit codes:
0 success, 1 syncd refused the request or the refit did not commit, 2 usage error, 3 syncd
unreachable, 130 stopped watching by Ctrl-C (the refit goes on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx

from syncd import http_client
from syncd.auth import ENV_TOKEN, ENV_TOKEN_FILE, TokenError, resolve_token
from syncd.error_body import error_message
from syncd.refit_wait import wait_final
from syncd.states import TERMINAL
from syncd.watch import Body, follow, view_for
from syncd.weight_version import WeightVersion, parse_weight_version

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 3, 130


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


class Api:
    def __init__(self, url: str, token: str | None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout)

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            reason = str(e) or type(e).__name__
            raise CliError(f"cannot reach syncd at {self.url}: {reason}", EXIT_UNREACHABLE) from None
        try:
            body = r.json()
        except ValueError:
            raise CliError(f"{method} {path}: HTTP {r.status_code}, not JSON: {r.text[:200]}") from None
        if r.status_code >= 400:
            raise CliError(f"{error_message(body)} (HTTP {r.status_code})")
        return body

    def follow(self, refit_id: str, timeout: float) -> Iterator[Body]:
        """The refit's updates until it ends (`syncd.watch.follow`), failures as CliError."""
        try:
            yield from follow(self._http, refit_id, timeout)
        except httpx.HTTPStatusError as e:
            raise CliError(f"{error_message(e.response.json())} (HTTP {e.response.status_code})") from None
        except httpx.TransportError as e:
            reason = str(e) or type(e).__name__
            raise CliError(f"cannot reach syncd at {self.url}: {reason}", EXIT_UNREACHABLE) from None
        except TimeoutError as e:
            raise CliError(str(e)) from None


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _duration(r: dict) -> str:
    return "" if r["finished_at"] is None else f"{r['finished_at'] - r['created_at']:.2f}s"


# ---- commands: each returns (json-able result, human text) ----


def cmd_status(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    s = api.call("GET", "/v1/status")
    r = s["readiness"]
    counts = ", ".join(f"{r['registered'][k]}/{r['expected'][k]} {k}s" for k in r["registered"])
    current = s["current_refit"]
    running = f" ({current['id']}, version {current['weight_version']})" if current else ""
    rows = [
        ("state", s["state"] + running),
        ("ready", ("yes" if r["ready"] else f"no: {r['reason']}") + f" [{counts}]"),
        ("committed version", _label(s["committed_run"], s["committed_version"])),
        ("announced version", _label(s["announced_run"], s["announced_version"])),
    ]
    return s, "\n".join(f"{k + ':':<19}{'-' if v is None else v}" for k, v in rows)


def _label(run_id: str | None, version: WeightVersion | None) -> str | None:
    """`version` alone names no weights (each training run counts from 1): show `run:version`."""
    return None if version is None else f"{run_id or ''}:{version}"


def _refit_label(r: Mapping[str, Any]) -> str | None:
    """A refit's version, prefixed by its adapter's name for a refit of a named adapter."""
    label = _label(r["run_id"], r["weight_version"])
    return f"{r['adapter']}@{label}" if r.get("adapter") else label


def cmd_adapters(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    body = api.call("GET", "/v1/adapters")
    rows = [
        (
            a["name"],
            a["rank"] if a["rank"] is not None else "-",
            ",".join(a["target_modules"]) or "-",
            " ".join(a["trainers"]) or "-",
            _label(a["run_id"], a["announced_version"]) or "-",
            _label(a["committed_run"], a["committed_version"]) or "-",
        )
        for a in body["adapters"]
    ]
    return body, table(("ADAPTER", "RANK", "TARGETS", "TRAINERS", "ANNOUNCED", "COMMITTED"), rows)


def cmd_members(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    body = api.call("GET", "/v1/members")
    rows = [
        (
            m["member_id"],
            m["role"],
            ",".join(f"{k}={v}" for k, v in m["coords"].items()),
            m["device"],
            m["data_address"] or "-",
            m["catalog_hash"][7:19],
        )
        for m in body["members"]
    ]
    return body, table(("MEMBER", "ROLE", "COORDS", "DEVICE", "DATA ADDRESS", "CATALOG"), rows)


def cmd_plan(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    p = api.call("GET", "/v1/plan")
    head = (
        f"{human_bytes(p['total_bytes'])} in {p['buckets']} buckets, {p['units']} units "
        f"(bucket size {human_bytes(p['bucket_bytes'])}); trainers send {human_bytes(p['source_bytes'])}, "
        f"generators relay {human_bytes(p['relay_bytes'])}"
    )
    stages = table(
        ("STAGE", "BYTES", "MEMBERS"),
        [(s["stage"], human_bytes(s["bytes"]), " ".join(s["members"])) for s in p["stages"]],
    )
    links = table(
        ("STAGE", "SRC", "DST", "VIA", "TRANSPORT", "BYTES", "BUCKETS", "UNITS"),
        [
            (
                k["stage"],
                k["src"],
                k["dst"],
                "relay" if k["relay"] else "trainer",
                k.get("transport") or "-",
                human_bytes(k["bytes"]),
                k["buckets"],
                k["units"],
            )
            for k in p["links"]
        ],
    )
    return p, f"{head}\n\n{stages}\n\n{links}"


def cmd_history(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    body = api.call("GET", "/v1/refits", params={"limit": args.limit})
    rows = [
        (
            r["id"],
            r["state"],
            _refit_label(r),
            _duration(r),
            r["mode"],
            human_bytes(r["bytes"]),
            human_bytes(r["planned_bytes"]),
            _changed(r),
            r["error"],
        )
        for r in body["refits"]
    ]
    return body, table(
        ("REFIT", "STATE", "VERSION", "DURATION", "MODE", "BYTES", "PLANNED", "CHANGED", "ERROR"), rows
    )


def _changed(r: Mapping[str, Any]) -> str:
    """The changed fraction of a delta refit (e.g. `0.93%`), `-` for a full one."""
    return "-" if r["changed_fraction"] is None else f"{100 * r['changed_fraction']:.2f}%"


def cmd_abort(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    r = api.call("POST", f"/v1/refits/{args.refit_id}/abort")
    return r, f"{r['id']} {r['state']}: {r['error']}"


def cmd_refit(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    body: dict[str, Any] = {} if args.version is None else {"weight_version": args.version}
    if args.allow_rollback:
        body["allow_rollback"] = True
    if args.full:
        body["full"] = True
    if args.adapter:
        body["adapter"] = args.adapter
    r = api.call("POST", "/v1/refits", json=body)
    if args.wait and args.json:
        r = _wait(api, r, args.timeout, quiet=True)
    elif args.wait:  # the progress on stderr: stdout keeps the outcome
        r = dict(_watch(api, r["id"], args.timeout, sys.stderr, as_json=False))
    what = f"adapter {r['adapter']} version" if r.get("adapter") else "weight version"
    text = f"{r['id']} {r['state']} ({what} {r['weight_version']})"
    if r["state"] in TERMINAL:
        text += f" in {_duration(r)}, {r['mode']}, {human_bytes(r['bytes'])}"
        if r["mode"] == "delta":
            text += f" of {human_bytes(r['planned_bytes'])} ({_changed(r)} changed)"
        text += f": {r['error']}" if r["error"] else ""
    if args.wait and r["state"] != "COMMITTED":
        raise CliError(text if not args.json else json.dumps(r))
    return r, text


def _wait(api: Api, refit: dict, timeout: float, quiet: bool) -> dict:
    """Poll until the refit finishes, showing each state as it is reached (on stderr)."""

    def show(body: Mapping[str, Any]) -> None:
        if not quiet:
            print(f"{body['id']}: {body['state']}", file=sys.stderr, flush=True)

    try:
        return dict(wait_final(lambda path: api.call("GET", path), refit["id"], timeout, on_state=show))
    except TimeoutError as e:
        raise CliError(str(e)) from None


def _watch(api: Api, refit_id: str, timeout: float, out: Any, as_json: bool) -> Body:
    """Draw the refit's progress on `out` until it ends; returns its last body. Ctrl-C stops the
    watching, never the refit."""
    view = view_for(out, as_json)
    last: Body | None = None
    try:
        for last in api.follow(refit_id, timeout):
            view.update(last)
    except KeyboardInterrupt:
        view.close()
        raise CliError(
            f"stopped watching {refit_id}; the refit goes on (syncctl watch {refit_id})", EXIT_INTERRUPTED
        ) from None
    view.close()
    assert last is not None  # `follow` ends only after the final state
    return last


def cmd_watch(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    """Follow a refit (default: the running one, else the newest) until it ends; exit 0 only
    when it COMMITTED. The updates are the output: nothing is printed after them."""
    refit_id = args.refit_id
    if refit_id is None:
        current = api.call("GET", "/v1/status")["current_refit"]
        newest = current or next(iter(api.call("GET", "/v1/refits", params={"limit": 1})["refits"]), None)
        if newest is None:
            raise CliError("no refit to watch: syncd has run none")
        refit_id = newest["id"]
    r = _watch(api, refit_id, args.timeout, sys.stdout, args.json)
    if r["state"] != "COMMITTED":
        raise CliError(f"{r['id']} {r['state']}: {r['error']}")
    return None, ""


def _generator_digests(url: str) -> list[dict[str, Any]]:
    """A generator's digest of what each of its workers holds (`GET /v1/weights/digest`)."""
    try:
        r = http_client.get(f"{url.rstrip('/')}/v1/weights/digest", timeout=120)
    except httpx.HTTPError as e:
        raise CliError(
            f"cannot reach generator at {url}: {str(e) or type(e).__name__}", EXIT_UNREACHABLE
        ) from None
    if r.status_code >= 400:
        raise CliError(f"generator {url}: {error_message(r.json())} (HTTP {r.status_code})")
    return list(r.json())


def cmd_verify(api: Api, args: argparse.Namespace) -> tuple[Any, str]:
    """Each generator worker's digest of what it holds against syncd's digest of the version it
    serves (the senders' checksums): exit 0 only when every region is equal."""
    workers = [w for url in args.generator for w in _generator_digests(url)]
    unavailable = [f"{w['member_id']}: {w['reason']}" for w in workers if not w["available"]]
    if unavailable:
        raise CliError("cannot verify: " + "; ".join(unavailable))
    members = {
        w["member_id"]: {"weight_version": int(w["version"]), "checksums": w["checksums"]} for w in workers
    }
    r = api.call("POST", "/v1/verify", json={"members": members})
    rows = [(w["member_id"], w["version"], len(w["checksums"])) for w in workers]
    text = table(("member", "version", "regions"), rows) + "\n"
    if r["equal"]:
        text += f"equal: {r['regions_compared']} regions hold what the trainers sent"
        return r, text
    diffs = [(d["member_id"], d["region"], d["expected"] or "-", d["got"] or "-") for d in r["differences"]]
    text += f"DIFFERENT: {', '.join(r['tensors'])}\n" + table(("member", "region", "sent", "holds"), diffs)
    raise CliError(text if not args.json else json.dumps(r))


def _weight_version(text: str) -> WeightVersion:
    try:
        return parse_weight_version(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON output")
    parser = argparse.ArgumentParser(prog="syncctl", description="Operate syncd.", parents=[common])
    parser.add_argument(
        "--url",
        default=os.environ.get("SYNCCTL_URL", "http://127.0.0.1:8470"),
        help="syncd HTTP URL (env SYNCCTL_URL)",
    )
    parser.add_argument("--token", default=None, help=f"bearer token for mutating calls (env {ENV_TOKEN})")
    parser.add_argument(
        "--token-file", default=None, help=f"file holding the bearer token (env {ENV_TOKEN_FILE})"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("status", parents=[common], help="state, readiness and versions")
    p.set_defaults(run=cmd_status)
    sub.add_parser("members", parents=[common], help="registered members").set_defaults(run=cmd_members)
    sub.add_parser("plan", parents=[common], help="summary of the current plan").set_defaults(run=cmd_plan)
    p = sub.add_parser("history", parents=[common], help="past refits, newest first")
    p.add_argument("--limit", type=int, default=20)
    p.set_defaults(run=cmd_history)
    p = sub.add_parser("abort", parents=[common], help="abort a running refit")
    p.add_argument("refit_id")
    p.set_defaults(run=cmd_abort)
    p = sub.add_parser("refit", parents=[common], help="start a refit")
    p.add_argument(
        "--version",
        type=_weight_version,
        default=None,
        help="weight version; must be the trainers' newest announced one (the default)",
    )
    p.add_argument(
        "--allow-rollback",
        action="store_true",
        help="allow moving a version older than the committed one of the same training run",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="move every byte even where delta refits are on (e.g. to rule out a bad base)",
    )
    p.add_argument(
        "--adapter",
        default=None,
        help="refit this named LoRA adapter into the generators' slots (--version is then the adapter's)",
    )
    p.add_argument("--wait", action="store_true", help="wait for the outcome; exit 0 only if COMMITTED")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait with --wait")
    p.set_defaults(run=cmd_refit)
    sub.add_parser("adapters", parents=[common], help="named LoRA adapters and their versions").set_defaults(
        run=cmd_adapters
    )
    p = sub.add_parser("watch", parents=[common], help="follow a refit live: bytes, rate, ETA, the slowest")
    p.add_argument("refit_id", nargs="?", default=None, help="default: the running refit, else the newest")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds to follow it at most")
    p.set_defaults(run=cmd_watch)
    p = sub.add_parser("verify", parents=[common], help="compare what generators hold with what was sent")
    p.add_argument(
        "--generator", action="append", required=True, help="a generator's HTTP URL (repeat for each)"
    )
    p.set_defaults(run=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.json = getattr(args, "json", False)
    try:
        token = resolve_token(args.token, args.token_file)
    except TokenError as e:
        print(f"syncctl: {e}", file=sys.stderr)
        return 2
    api = Api(args.url.rstrip("/"), token)
    try:
        result, text = args.run(api, args)
    except CliError as e:
        print(f"syncctl: {e}", file=sys.stderr)
        return e.code
    if result is not None or text:  # `watch` showed its output as it went
        print(json.dumps(result, indent=2) if args.json else text)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
