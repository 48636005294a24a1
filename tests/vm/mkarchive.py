"""Make a one-layer `docker save` archive from a rootfs directory (the lane's microVM image).

    python3 mkarchive.py ROOTFS OUT.tar [TAG]
"""

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile


def main(src: str, out: str, tag: str = "pyimg:latest") -> None:
    tmp = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(out)))
    layer = os.path.join(tmp, "layer.tar")
    try:
        subprocess.run(["tar", "--numeric-owner", "--xattrs", "-C", src, "-cf", layer, "."], check=True)
        digest = hashlib.sha256()
        with open(layer, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
        config = json.dumps({
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                       "Cmd": ["/bin/bash"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + digest.hexdigest()]},
            "history": [{"created_by": "smolbench tests/vm/mkarchive.py"}],
        }).encode()
        config_name = hashlib.sha256(config).hexdigest() + ".json"
        layer_dir = digest.hexdigest()
        repo, _, version = tag.partition(":")
        manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": [layer_dir + "/layer.tar"]}]
        with tarfile.open(out + ".tmp", "w") as tar:

            def add(name: str, data: bytes) -> None:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))

            add(config_name, config)
            tar.add(layer, arcname=layer_dir + "/layer.tar")
            add("manifest.json", json.dumps(manifest).encode())
            add("repositories", json.dumps({repo: {version or "latest": layer_dir}}).encode())
        os.replace(out + ".tmp", out)
    finally:
        if os.path.exists(layer):
            os.remove(layer)
        os.rmdir(tmp)


if __name__ == "__main__":
    main(*sys.argv[1:4])
