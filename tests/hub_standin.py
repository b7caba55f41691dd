"""A local stand-in for the Hugging Face Hub HTTP API: just the routes `HfApi.upload_folder` and friends call, and
those that list a repository's branches and files and download a revision's files (`list_repo_refs`,
`list_repo_tree`, `hf_hub_download`, `snapshot_download`).

It answers the real `huggingface_hub` client, so the tests exercise its actual code path without the network.
Files are stored inline ("regular" upload mode for every file), so no LFS or Xet storage is involved.
Every request is recorded (method, path, headers, body) so tests can check what the client sent;
a route the stand-in does not know is recorded in `unknown_routes` and answered 404, so a new client call shows up.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import random
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

REPO = r"(?P<repo>[^/]+/[^/]+)"
# The Hub address of a pytest process's programs (HF_ENDPOINT), on a port of this range: above cram.slurm's job ports
# (12000-31999), below Linux's ephemeral ports (32768-60999), which every other port of the suite is.
SESSION_PORTS = range(32000, 32768)
SESSION_PORT = "CRAM_TEST_HUB_PORT"
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


@dataclass
class StoredRepo:
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: dict[str, list[str]] = field(default_factory=lambda: {"main": []})  # commit summaries per branch


def reserve_session_endpoint() -> None:
    """Point every program this pytest process starts at one Hub address of its own (HF_ENDPOINT): a stand-in made
    with `session_address` listens there while its test runs, and nothing does otherwise, so a client that reaches
    for the Hub outside one is refused at once, as with no network. huggingface_hub reads HF_ENDPOINT as it loads,
    so the programs a test points at such a stand-in share the environment of every other program and fork from the
    same zygote (tests/zygote.py). Where no port of SESSION_PORTS is free, none is set, and every stand-in takes a
    port of its own."""
    generator = random.Random(os.getpid())
    for port in generator.sample(SESSION_PORTS, 16):
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port))
            os.environ.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", **{SESSION_PORT: str(port)})
            return


class ClosingHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that closes the connections it still holds when it closes: a client keeps its connection
    alive for the next request (huggingface_hub's pool), which would reach this stand-in's state after the next one
    listens on the same port."""

    daemon_threads = True

    def __init__(self, *arguments: object) -> None:
        super().__init__(*arguments)
        self.connections: set[socket.socket] = set()

    def process_request(self, request: socket.socket, client_address: object) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: socket.socket) -> None:
        self.connections.discard(request)
        super().shutdown_request(request)

    def server_close(self) -> None:
        super().server_close()
        for connection in list(self.connections):
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class HubStandIn:
    """Run with `with HubStandIn(token=...) as hub:`; `hub.endpoint` is the URL to point the client at.

    With `token` set, a request without `Authorization: Bearer <token>` gets the Hub's 401 answer. With
    `session_address`, it listens at the address every program of this pytest process is given (HF_ENDPOINT,
    `reserve_session_endpoint`), so the programs a test points at it need no environment of their own; else, and
    where another stand-in listens there, on a port of its own.
    """

    def __init__(self, token: str | None = None, session_address: bool = False) -> None:
        self.token = token
        self.repos: dict[str, StoredRepo] = {}
        self.requests: list[RecordedRequest] = []
        self.unknown_routes: list[str] = []
        self.commit_refusal: tuple[int, str] | None = None  # (status, reason) to answer every commit with
        self.in_flight = self.most_in_flight = 0  # requests arrived and not yet answered: now, and at most
        # Held while a request changes or reads the state above, not while it waits (`before_answer`): requests are
        # answered side by side, as the Hub answers them, so a client that sends two at once is seen doing it.
        self.lock = threading.Lock()
        port = int(os.environ.get(SESSION_PORT, 0)) if session_address else 0
        try:
            self.server = ClosingHTTPServer(("127.0.0.1", port), self.handler_class())
        except OSError:  # another stand-in listens there
            self.server = ClosingHTTPServer(("127.0.0.1", 0), self.handler_class())
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="hub-standin", daemon=True
        )

    def __enter__(self) -> HubStandIn:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=60)  # a guard: shutdown() returns once serve_forever has

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        with self.lock:
            return self.repos[repo_id].branches[revision]

    def before_answer(self, method: str, path: str) -> None:
        """Called for each authorised request before it is answered, outside the lock: a stand-in that holds a
        request back (tests/test_hub_background.py) overrides it, and holds back that request alone."""

    @contextlib.contextmanager
    def counted_in_flight(self) -> Iterator[None]:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            yield
        finally:
            with self.lock:
                self.in_flight -= 1

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client expects

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
                pass  # quiet: the tests read `hub.requests` instead

            def do_GET(self) -> None:
                self.handle_request()

            def do_POST(self) -> None:
                self.handle_request()

            def do_PUT(self) -> None:
                self.handle_request()

            def do_DELETE(self) -> None:
                self.handle_request()

            def do_HEAD(self) -> None:
                self.handle_request()

            def read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while size := int(self.rfile.readline().strip() or b"0", 16):
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    self.rfile.readline()
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def reply(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
                """JSON, or a file's bytes as they are; a HEAD request gets the headers alone."""
                raw = isinstance(payload, bytes)
                data = payload if raw else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/octet-stream" if raw else "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def handle_request(self) -> None:
                with hub.counted_in_flight():
                    self.reply(*self.answer(self.read_body(), urlsplit(self.path).path))

            def answer(self, body: bytes, path: str) -> tuple:
                headers = {name.lower(): value for name, value in self.headers.items()}
                with hub.lock:
                    hub.requests.append(RecordedRequest(self.command, self.path, headers, body))
                if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return 401, {"error": INVALID_CREDENTIALS}, {"X-Error-Message": INVALID_CREDENTIALS}
                hub.before_answer(self.command, path)
                with hub.lock:
                    for method, pattern, route in hub.routes():
                        match = re.fullmatch(pattern, path)
                        if method == self.command and match:
                            arguments = {name: unquote(value) for name, value in match.groupdict().items() if value}
                            return route(body, **arguments)
                    hub.unknown_routes.append(f"{self.command} {self.path}")
                return 404, {"error": f"the stand-in has no route {self.command} {path}"}

        return Handler

    def routes(self) -> list[tuple[str, str, Callable[..., tuple]]]:
        return [
            ("POST", r"/api/repos/create", self.create_repo),
            ("POST", r"/api/validate-yaml", self.validate_yaml),
            ("POST", rf"/api/models/{REPO}/branch/(?P<branch>[^/]+)", self.create_branch),
            ("POST", rf"/api/models/{REPO}/preupload/(?P<revision>[^/]+)", self.preupload),
            ("POST", rf"/api/models/{REPO}/commit/(?P<revision>[^/]+)", self.commit),
            ("GET", rf"/api/models/{REPO}/refs", self.refs),
            ("GET", rf"/api/models/{REPO}/tree/(?P<revision>[^/]+)(?:/(?P<folder>.*))?", self.tree),
            ("GET", r"/api/agent-harnesses", self.agent_harnesses),
            ("GET", rf"/api/models/{REPO}(?:/revision/(?P<revision>[^/]+))?", self.repo_info),
            ("HEAD", rf"/{REPO}/resolve/(?P<revision>[^/]+)/(?P<filename>.+)", self.resolve),
            ("GET", rf"/{REPO}/resolve/(?P<revision>[^/]+)/(?P<filename>.+)", self.resolve),
        ]

    # Routes: each returns (status, JSON payload[, extra headers]).

    def repo_not_found(self, repo: str) -> tuple:
        return 404, {"error": f"Repository {repo} not found"}, {"X-Error-Code": "RepoNotFound"}

    def revision_not_found(self, revision: str) -> tuple:
        return 404, {"error": f"Invalid rev id: {revision}"}, {"X-Error-Code": "RevisionNotFound"}

    def create_repo(self, body: bytes) -> tuple:
        request = json.loads(body)
        repo_id = f"{request['organization']}/{request['name']}" if request.get("organization") else request["name"]
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"}
        # huggingface_hub 1.x sends `private`; 2.x sends `visibility`. An unset one means public, as on the Hub.
        private = request.get("visibility") == "private" or request.get("private") is True
        self.repos[repo_id] = StoredRepo(private=private)
        return 200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id, "id": repo_id}

    def validate_yaml(self, body: bytes) -> tuple:
        """Check the README's front matter parses to a mapping, as the Hub does before accepting a card."""
        content = json.loads(body)["content"]
        parts = content.split("---\n", 2) if content.startswith("---\n") else []
        try:
            metadata = yaml.safe_load(parts[1]) if len(parts) == 3 else None
        except yaml.YAMLError as err:
            return 400, {"errors": [{"message": f"invalid YAML: {err}"}]}
        if not isinstance(metadata, dict):
            return 400, {"errors": [{"message": "the README has no YAML front matter"}]}
        return 200, {"errors": [], "warnings": []}

    def create_branch(self, body: bytes, repo: str, branch: str) -> tuple:
        if repo not in self.repos:
            return self.repo_not_found(repo)
        stored = self.repos[repo]
        if branch in stored.branches:
            return 409, {"error": f"Reference already exists: refs/heads/{branch}"}
        starting_point = json.loads(body or b"{}").get("startingPoint", "main")
        stored.branches[branch] = dict(stored.branches[starting_point])
        stored.commits[branch] = list(stored.commits[starting_point])
        return 200, {}

    def preupload(self, body: bytes, repo: str, revision: str) -> tuple:
        if repo not in self.repos:
            return self.repo_not_found(repo)
        if revision not in self.repos[repo].branches:
            return self.revision_not_found(revision)
        files = json.loads(body)["files"]
        # "regular" for every file: the content travels inline in the commit, no LFS or Xet upload.
        answer = [{"path": file["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for file in files]
        return 200, {"files": answer}

    def commit(self, body: bytes, repo: str, revision: str) -> tuple:
        if repo not in self.repos:
            return self.repo_not_found(repo)
        stored = self.repos[repo]
        if revision not in stored.branches:
            return self.revision_not_found(revision)
        if self.commit_refusal is not None:
            status, reason = self.commit_refusal
            return status, {"error": reason}
        files = dict(stored.branches[revision])  # a commit lands whole or not at all
        summary = ""
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                summary = value["summary"]
            elif key == "file" and value.get("encoding") == "base64":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                files.pop(value["path"], None)
            else:
                return 400, {"error": f"the stand-in does not handle commit operation {key!r}"}
        stored.branches[revision] = files
        stored.commits[revision].append(summary)
        oid = self.head(repo, revision)
        return 200, {"commitUrl": f"{self.endpoint}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}

    def repo_info(self, body: bytes, repo: str, revision: str | None = None) -> tuple:
        if repo not in self.repos:
            return self.repo_not_found(repo)
        stored = self.repos[repo]
        revision = revision or "main"
        if revision not in stored.branches:
            return self.revision_not_found(revision)
        siblings = [{"rfilename": path} for path in sorted(stored.branches[revision])]
        return 200, {"id": repo, "sha": self.head(repo, revision), "private": stored.private, "siblings": siblings}

    def refs(self, body: bytes, repo: str) -> tuple:
        """The repository's branches, as `HfApi.list_repo_refs` reads them."""
        if repo not in self.repos:
            return self.repo_not_found(repo)
        branches = [{"name": name, "ref": f"refs/heads/{name}", "targetCommit": self.head(repo, name)}
                    for name in sorted(self.repos[repo].branches)]
        return 200, {"branches": branches, "converts": [], "tags": []}

    def tree(self, body: bytes, repo: str, revision: str, folder: str = "") -> tuple:
        """The files and folders under `folder` of a revision, all depths (what `snapshot_download` lists with
        `recursive=True`), in one page: no Link header, so the client asks for no next one."""
        if repo not in self.repos:
            return self.repo_not_found(repo)
        stored = self.repos[repo]
        revision = next((name for name in stored.branches if self.head(repo, name) == revision), revision)
        if revision not in stored.branches:
            return self.revision_not_found(revision)
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        paths = sorted(path for path in stored.branches[revision] if path.startswith(prefix))
        folders = sorted({"/".join(path.split("/")[:depth]) for path in paths
                          for depth in range(prefix.count("/") + 1, path.count("/") + 1)})
        entries = [{"type": "directory", "path": name, "oid": hashlib.sha1(name.encode()).hexdigest(), "size": 0}
                   for name in folders]
        for path in paths:
            content = stored.branches[revision][path]
            blob = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()  # git's id of the file
            entries.append({"type": "file", "path": path, "oid": blob, "size": len(content)})
        return 200, entries

    def agent_harnesses(self, body: bytes) -> tuple:
        """The registry of agent harnesses huggingface_hub fetches to name one in its user agent: none here."""
        return 200, {"standardEnvVars": [], "harnesses": {}}

    def resolve(self, body: bytes, repo: str, revision: str, filename: str) -> tuple:
        """A file of a revision, with the headers `hf_hub_download` reads (the commit, the ETag, the size)."""
        if repo not in self.repos:
            return self.repo_not_found(repo)
        stored = self.repos[repo]
        # The client asks for a branch's files by the commit id its repo_info named, as on the Hub.
        revision = next((name for name in stored.branches if self.head(repo, name) == revision), revision)
        if revision not in stored.branches:
            return self.revision_not_found(revision)
        if filename not in stored.branches[revision]:
            return 404, {"error": f"Entry not found: {filename}"}, {"X-Error-Code": "EntryNotFound"}
        content = stored.branches[revision][filename]
        return 200, content, {"X-Repo-Commit": self.head(repo, revision),
                              "ETag": f'"{hashlib.sha256(content).hexdigest()}"'}

    def head(self, repo: str, revision: str) -> str:
        """A stable 40-hex commit id for the branch's history so far."""
        history = json.dumps([repo, revision, self.repos[repo].commits[revision]]).encode()
        return hashlib.sha1(history).hexdigest()


def closed_port() -> int:
    """A local port nothing listens on: an unreachable Hub."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens once the probe closes


def unreachable_endpoint() -> str:
    """A Hub address nothing answers at, for a program to find the Hub unreachable: the session's (nothing listens
    there outside a `session_address` stand-in, and its programs fork as every other does), else a closed port's."""
    if SESSION_PORT in os.environ:
        return os.environ["HF_ENDPOINT"]
    return f"http://127.0.0.1:{closed_port()}"
