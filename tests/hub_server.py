"""A loopback stand-in for the Hugging Face Hub, enough for `create_repo`, `upload_folder`/`push_to_hub` (regular,
non-LFS uploads) and `from_pretrained`/`hf_hub_download`: a stdlib ThreadingHTTPServer on 127.0.0.1 holding model
repositories in memory. Point `HF_ENDPOINT` at `server.url` *before* huggingface_hub is imported (it reads the
variable at import), e.g. in a subprocess's environment.

    with LocalHub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "test-token"}
        subprocess.run([...], env=env)
        hub.files("tester/model")  # {"config.json": b"...", ...}
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

USER = "tester"
REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
REV = r"(?P<rev>[^/]+)"


class Repository:
    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.commits: list[str] = [hashlib.sha1(b"initial").hexdigest()]

    @property
    def head(self) -> str:
        return self.commits[-1]

    def commit(self, added: dict[str, bytes], deleted: list[str], message: str) -> str:
        self.files.update(added)
        for path in deleted:
            self.files.pop(path, None)
        digest = hashlib.sha1((self.head + message + "".join(sorted(added)) + str(len(self.commits))).encode())
        self.commits.append(digest.hexdigest())
        return self.head


class LocalHub:
    """Start with `with LocalHub() as hub:`; `hub.requests` lists (method, path, status) for debugging."""

    def __init__(self):
        self.repos: dict[str, Repository] = {}
        self.requests: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                hub.dispatch(self, "GET")

            def do_HEAD(self):
                hub.dispatch(self, "HEAD")

            def do_POST(self):
                hub.dispatch(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo_id: str) -> dict[str, bytes]:
        return dict(self.repos[repo_id].files)

    # -- routing -----------------------------------------------------------------------------------------------
    def dispatch(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlparse(handler.path).path)
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        routes = [
            ("GET", r"/api/whoami-v2", self.whoami),
            ("POST", r"/api/repos/create", self.create_repo),
            ("POST", r"/api/validate-yaml", lambda h, m, b: self.json(h, {})),
            ("POST", rf"/api/models/{REPO}/preupload/{REV}", self.preupload),
            ("POST", rf"/api/models/{REPO}/commit/{REV}", self.commit),
            ("POST", rf"/api/models/{REPO}/paths-info/{REV}", self.paths_info),
            ("GET", rf"/api/models/{REPO}/tree/{REV}(?:/(?P<folder>.*))?", self.tree),
            ("GET", rf"/api/models/{REPO}/revision/{REV}", self.model_info),
            ("GET", rf"/api/models/{REPO}", self.model_info),
            (None, rf"/{REPO}/resolve/{REV}/(?P<file>.+)", self.resolve),
        ]
        for want, pattern, route in routes:
            match = re.fullmatch(pattern, path)
            if match and (want is None or want == method):
                with self.lock:
                    status = route(handler, match, body)
                break
        else:
            status = self.error(handler, 404, "NotFound", f"no route for {method} {path}")
        self.requests.append((method, path, status))

    # -- responses ---------------------------------------------------------------------------------------------
    @staticmethod
    def json(handler, value, status: int = 200, headers: dict | None = None) -> int:
        data = json.dumps(value).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        for key, val in (headers or {}).items():
            handler.send_header(key, val)
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)
        return status

    def error(self, handler, status: int, code: str, message: str, commit: str | None = None) -> int:
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        if commit:
            headers["X-Repo-Commit"] = commit
        return self.json(handler, {"error": message}, status, headers)

    def repo(self, handler, match) -> Repository | None:
        repo = self.repos.get(match["repo"])
        if repo is None:
            self.error(handler, 404, "RepoNotFound", f"Repository {match['repo']} not found")
        return repo

    # -- endpoints ---------------------------------------------------------------------------------------------
    def whoami(self, handler, match, body) -> int:
        return self.json(handler, {"type": "user", "name": USER, "orgs": [],
                                   "auth": {"type": "access_token", "accessToken": {"role": "write"}}})

    def create_repo(self, handler, match, body) -> int:
        request = json.loads(body or b"{}")
        namespace = request.get("organization") or USER
        repo_id = f"{namespace}/{request['name']}"
        existed = repo_id in self.repos
        self.repos.setdefault(repo_id, Repository())
        # 409 is what the Hub answers for an existing repository; create_repo(exist_ok=True) accepts it.
        return self.json(handler, {"url": f"{self.url}/{repo_id}", "name": repo_id}, 409 if existed else 200)

    def preupload(self, handler, match, body) -> int:
        if (repo := self.repo(handler, match)) is None:
            return 404
        files = json.loads(body).get("files", [])
        # "regular": contents travel base64-encoded inside the commit call (no LFS or Xet transfer).
        return self.json(handler, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                             for f in files], "commitOid": repo.head})

    def commit(self, handler, match, body) -> int:
        if (repo := self.repo(handler, match)) is None:
            return 404
        added, deleted, message = {}, [], ""
        for line in body.decode().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            value = item.get("value", {})
            if item["key"] == "header":
                message = value.get("summary", "")
            elif item["key"] == "file":
                added[value["path"]] = base64.b64decode(value["content"])
            elif item["key"] in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            elif item["key"] == "lfsFile":
                return self.error(handler, 400, "BadRequest", "this stand-in accepts regular uploads only")
        oid = repo.commit(added, deleted, message)
        return self.json(handler, {"commitUrl": f"{self.url}/{match['repo']}/commit/{oid}", "commitOid": oid,
                                   "pullRequestUrl": None})

    def entry(self, path: str, content: bytes) -> dict:
        return {"type": "file", "path": path, "size": len(content), "oid": hashlib.sha1(content).hexdigest()}

    def paths_info(self, handler, match, body) -> int:
        if (repo := self.repo(handler, match)) is None:
            return 404
        try:
            paths = json.loads(body).get("paths", [])
        except json.JSONDecodeError:  # form-encoded
            paths = re.findall(r"paths=([^&]+)", unquote(body.decode()))
        return self.json(handler, [self.entry(p, repo.files[p]) for p in paths if p in repo.files])

    def tree(self, handler, match, body) -> int:
        if (repo := self.repo(handler, match)) is None:
            return 404
        folder = (match["folder"] or "").strip("/")
        prefix = f"{folder}/" if folder else ""
        entries, folders = [], set()
        for path, content in sorted(repo.files.items()):
            if not path.startswith(prefix):
                continue
            rest = path[len(prefix):]
            if "/" in rest:
                folders.add(prefix + rest.split("/")[0])
            else:
                entries.append(self.entry(path, content))
        entries += [{"type": "directory", "path": f, "oid": "0" * 40} for f in sorted(folders)]
        return self.json(handler, entries)

    def model_info(self, handler, match, body) -> int:
        if (repo := self.repo(handler, match)) is None:
            return 404
        return self.json(handler, {"id": match["repo"], "modelId": match["repo"], "sha": repo.head,
                                   "private": False, "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                                   "tags": [], "downloads": 0, "likes": 0})

    def resolve(self, handler, match, body) -> int:
        if (repo := self.repo(handler, match)) is None:
            return 404
        content = repo.files.get(match["file"])
        if content is None:
            return self.error(handler, 404, "EntryNotFound", f"{match['file']} does not exist", repo.head)
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(content)))
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("ETag", f'"{hashlib.sha1(content).hexdigest()}"')
        handler.send_header("X-Repo-Commit", repo.head)
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(content)
        return 200
