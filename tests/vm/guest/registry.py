"""A read-only OCI registry for the lane (runs in L1): serves a `docker save` archive.

    python3 registry.py ARCHIVE NAME PORT

smol captures a whole machine (checkpoint) only when its image lives on the machine's own
storage, i.e. was pulled from a registry; no registry is reachable from the lane, so this
one serves the lane's image on 127.0.0.1 (smol pulls from a loopback registry over plain
HTTP; the machine needs ``allow_cidrs = ["127.0.0.1/32:5000"]``: a range never reaches this host). Lane-only, stdlib only.
"""

import hashlib
import http.server
import json
import sys
import tarfile


def load(archive: str) -> tuple[bytes, str, dict[str, bytes]]:
    """(manifest, its digest, blobs by digest) for the one image in a docker-save archive."""
    blobs: dict[str, bytes] = {}

    def put(data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest

    with tarfile.open(archive) as tar:
        entry = json.load(tar.extractfile("manifest.json"))[0]  # type: ignore[arg-type]
        config = tar.extractfile(entry["Config"]).read()  # type: ignore[union-attr]
        layers = [tar.extractfile(name).read() for name in entry["Layers"]]  # type: ignore[union-attr]
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": put(layer),
                    "size": len(layer)} for layer in layers],
    }).encode()
    return manifest, put(manifest), blobs


def main(archive: str, name: str, port: str) -> None:
    manifest, manifest_digest, blobs = load(archive)

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, head: bool) -> None:
            path = self.path.split("?")[0]
            body, ctype, extra = b'{"errors":[{"code":"NOT_FOUND"}]}', "application/json", {}
            code = 404
            if path in ("/v2", "/v2/"):
                code, body = 200, b"{}"
            elif path.startswith(f"/v2/{name}/manifests/"):
                code, body, ctype = 200, manifest, "application/vnd.oci.image.manifest.v1+json"
                extra = {"Docker-Content-Digest": manifest_digest}
            elif path.startswith(f"/v2/{name}/blobs/") and path.rsplit("/", 1)[1] in blobs:
                digest = path.rsplit("/", 1)[1]
                code, body, ctype = 200, blobs[digest], "application/octet-stream"
                extra = {"Docker-Content-Digest": digest}
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            for key, value in extra.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            self.answer(False)

        def do_HEAD(self) -> None:  # noqa: N802
            self.answer(True)

        def log_message(self, *args: object) -> None:
            pass

    print(f"registry: 127.0.0.1:{port}/{name}:latest from {archive}", flush=True)
    http.server.ThreadingHTTPServer(("127.0.0.1", int(port)), Handler).serve_forever()


if __name__ == "__main__":
    main(*sys.argv[1:4])
