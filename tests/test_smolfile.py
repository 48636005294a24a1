"""Tests of the Smolfile parser: good inputs and one-line errors."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from smolbench import smolfile
from smolbench.errors import SmolfileError
from smolbench.smolfile import load_smolfile, parse_smolfile
from smolbench.spec import MachineSpec, Volume

TOP_ALLOWED = (
    "allowed keys: branch, cluster, cpus, disk, env, episodes, image, init, init_timeout, max_alive, memory, net, "
    "network, packages, pids, volumes, workdir"
)
HOST_FIX = 'write a hostname like "pypi.org", optionally with a port like "pypi.org:443"'


@pytest.fixture(autouse=True)
def host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed host (8 cores, 16 GiB) so the upper-bound messages don't depend on this machine."""
    monkeypatch.setattr(smolfile, "host_cpus", lambda: 8)
    monkeypatch.setattr(smolfile, "host_memory_mib", lambda: 16384)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A Smolfile directory with a fake rootfs, a data dir and a dir without python3."""
    (tmp_path / "rootfs" / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "rootfs" / "usr" / "bin" / "python3").write_text("")
    (tmp_path / "data").mkdir()
    (tmp_path / "empty").mkdir()
    return tmp_path


FULL = """\
# every key
image = "./rootfs"
cpus = 4
memory = "2G"
net = true
workdir = "/work"
init = ["pip install numpy", "echo ready"]
volumes = [
  { host = "data", guest = "/data" },
  { host = "empty", guest = "/scratch", readonly = false },
]

[env]
SEED = "0"
ALPHA = "a b"

[network]
allow_hosts = ["pypi.org", "files.pythonhosted.org:443"]
allow_cidrs = ["10.1.2.3/8", "192.168.1.7"]

[branch]
enabled = false
"""


def test_full_smolfile(base: Path) -> None:
    spec = parse_smolfile(FULL, base_dir=str(base))
    assert spec == MachineSpec(
        image=str(base / "rootfs"),
        cpus=4,
        memory=2048,
        net=True,
        allow_hosts=("pypi.org", "files.pythonhosted.org:443"),
        allow_cidrs=("10.0.0.0/8", "192.168.1.7/32"),
        env=(("ALPHA", "a b"), ("SEED", "0")),
        workdir="/work",
        init=("pip install numpy", "echo ready"),
        volumes=(
            Volume(host=str(base / "data"), guest="/data", readonly=True),
            Volume(host=str(base / "empty"), guest="/scratch", readonly=False),
        ),
        branch=False,
    )
    assert spec.source == "Smolfile"
    assert spec.env_dict == {"ALPHA": "a b", "SEED": "0"}


def test_limit_keys() -> None:
    spec = parse_smolfile('pids = 64\ndisk = "512M"\ninit_timeout = 2.5\nmax_alive = 3\nmemory = "1G"')
    assert (spec.pids, spec.disk_mib, spec.init_timeout, spec.max_alive, spec.memory) == (64, 512, 2.5, 3, 1024)
    default = MachineSpec()
    assert (default.pids, default.disk_mib, default.init_timeout, default.max_alive) == (256, None, 300.0, 8)
    # policy keys do not change what the machine is; limits do
    assert spec.baseline() != default.baseline()
    assert parse_smolfile("max_alive = 2\ninit_timeout = 9").baseline() == default.baseline()


def test_real_host_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against this machine's own RAM and cores (no fixed host)."""
    monkeypatch.undo()
    with pytest.raises(SmolfileError, match=r"^Smolfile line 1: 'memory' is more than this host's RAM \(\d+ MiB\), got '10000T'"):
        parse_smolfile('memory = "10000T"')
    too_many = (os.cpu_count() or 1) + 1
    with pytest.raises(SmolfileError, match=rf"^Smolfile line 1: 'cpus' is more than this host's \d+ cores, got {too_many}"):
        parse_smolfile(f"cpus = {too_many}")


def test_empty_smolfile_is_the_default() -> None:
    assert parse_smolfile("") == MachineSpec()
    assert parse_smolfile("# nothing\n").image is None


@pytest.mark.parametrize(
    ("value", "mib"),
    [
        ("2048", 2048),
        ('"2G"', 2048),
        ('"2g"', 2048),
        ('"2GiB"', 2048),
        ('"512M"', 512),
        ('"1.5G"', 1536),
        ('"1024"', 1024),
        ('"262144K"', 256),
    ],
)
def test_memory_sizes(value: str, mib: int) -> None:
    assert parse_smolfile(f"memory = {value}").memory == mib


def test_init_string_and_list() -> None:
    assert parse_smolfile('init = "apt-get update"').init == ("apt-get update",)
    assert parse_smolfile('init = ["a", "b"]').init == ("a", "b")
    assert parse_smolfile("init = []").init == ()


def test_image_names_are_kept() -> None:
    assert parse_smolfile('image = "debian:bookworm"').image == "debian:bookworm"
    assert parse_smolfile('image = "python:3.12-slim"').image == "python:3.12-slim"
    ref = "ghcr.io/org/img:1.0@sha256:abc"
    assert parse_smolfile(f'image = "{ref}"').image == ref


def test_rootfs_path_relative_to_base_dir(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/")
    sub = base / "sub"
    sub.mkdir()
    spec = parse_smolfile('image = "../rootfs"', base_dir=str(sub))
    assert spec.image == str(base / "rootfs")
    assert parse_smolfile(f'image = "{base}/rootfs"').image == str(base / "rootfs")


def test_rootfs_path_with_tilde(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(base))
    assert parse_smolfile('image = "~/rootfs"').image == str(base / "rootfs")


def test_volumes_as_array_of_tables(base: Path) -> None:
    text = (
        '[[volumes]]\nhost = "data"\nguest = "/data/"\n[[volumes]]\nhost = "empty"\nguest = "/e"\n'
    )
    spec = parse_smolfile(text, base_dir=str(base))
    assert spec.volumes == (
        Volume(host=str(base / "data"), guest="/data"),
        Volume(host=str(base / "empty"), guest="/e"),
    )


def test_dotted_keys_and_duplicates() -> None:
    spec = parse_smolfile('network.allow_hosts = ["a.org", "a.org"]\nbranch.enabled = true')
    assert spec.allow_hosts == ("a.org",)
    assert spec.branch is True
    assert spec.network_enabled


def test_load_smolfile(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/")
    path = base / "Smolfile"
    path.write_text('image = "./rootfs"\ncpus = 2\nvolumes = [{ host = "data", guest = "/d" }]\n')
    spec = load_smolfile(path)
    assert spec.source == str(path)
    assert spec.image == str(base / "rootfs")
    assert spec.cpus == 2
    assert spec.volumes == (Volume(host=str(base / "data"), guest="/d"),)


def test_load_smolfile_errors_name_the_file(base: Path) -> None:
    path = base / "Smolfile"
    path.write_text("\ncpus = 0\n")
    with pytest.raises(SmolfileError) as err:
        load_smolfile(path)
    assert str(err.value) == f"{path} line 2: 'cpus' must be an integer >= 1, got 0"
    with pytest.raises(SmolfileError, match="no such Smolfile"):
        load_smolfile(base / "missing")


BAD: list[tuple[str, str, str]] = [
    (
        "unknown-key",
        'image = "debian:bookworm"\ncpu = 2',
        f"Smolfile line 2: unknown key 'cpu' (did you mean 'cpus'?); {TOP_ALLOWED}",
    ),
    (
        "unknown-key-no-suggestion",
        "zzz = 1",
        f"Smolfile line 1: unknown key 'zzz'; {TOP_ALLOWED}",
    ),
    (
        "unknown-network-key",
        'cpus = 1\n[network]\nallow_host = ["pypi.org"]',
        "Smolfile line 3: unknown key 'allow_host' in [network] (did you mean 'allow_hosts'?); "
        "allowed keys: allow_cidrs, allow_hosts",
    ),
    (
        "unknown-table",
        "cpus = 1\n\n[netwrk]\nallow_hosts = []",
        "Smolfile line 3: unknown table [netwrk] (did you mean [network]?); "
        "allowed tables: [branch], [cluster], [env], [episodes], [network], [[volumes]]",
    ),
    (
        "unknown-branch-key",
        "[branch]\nenable = false",
        "Smolfile line 2: unknown key 'enable' in [branch] (did you mean 'enabled'?); "
        "allowed keys: enabled",
    ),
    (
        "env-dotted-key",  # the table a dotted key makes is on the key's line, not the section's
        'cpus = 1\n[env]\nX = "1"\nA.B = "x"',
        "Smolfile line 4: [env] value of 'A' must be a string, got a table",
    ),
    (
        "env-quoted-dotted-name",  # a quoted key's dots are part of its name
        '[env]\nX = "1"\n"A.B" = "x"',
        "Smolfile line 3: [env] name 'A.B' is not a valid variable name; "
        "use letters, digits and _ (not starting with a digit)",
    ),
    (
        "network-not-table",
        "network = true",
        "Smolfile line 1: 'network' must be a table (a [network] section), got boolean true",
    ),
    (
        "cpus-string",
        'cpus = "4"',
        "Smolfile line 1: 'cpus' must be an integer >= 1, got string '4' "
        "(write cpus = 4, without quotes)",
    ),
    (
        "cpus-bool",
        "net = false\ncpus = true",
        "Smolfile line 2: 'cpus' must be an integer >= 1, got boolean true",
    ),
    ("cpus-negative", "cpus = -2", "Smolfile line 1: 'cpus' must be an integer >= 1, got -2"),
    ("cpus-too-many", "cpus = 65", "Smolfile line 1: 'cpus' must be an integer <= 64, got 65"),
    (
        "cpus-float",
        "cpus = 1.5",
        "Smolfile line 1: 'cpus' must be an integer >= 1, got float 1.5",
    ),
    (
        "memory-too-small",
        "memory = 64",
        "Smolfile line 1: 'memory' must be at least 128 MiB, got 64; write memory = 128 or more",
    ),
    (
        "memory-string-too-small",
        'memory = "64M"',
        "Smolfile line 1: 'memory' must be at least 128 MiB, got '64M' (64 MiB); "
        "write memory = 128 or more",
    ),
    (
        "memory-bad-string",
        'memory = "lots"',
        "Smolfile line 1: 'memory' 'lots' is not a size; use a number with an optional unit "
        'K, M, G or T (like "512M" or "2G"); write memory = 2048 (MiB) or memory = "2G"',
    ),
    (
        "memory-fraction-of-mib",
        'memory = "1000.5M"',
        "Smolfile line 1: 'memory' '1000.5M' is not a whole number of MiB; "
        'write memory = 2048 (MiB) or memory = "2G"',
    ),
    (
        "memory-bool",
        "memory = true",
        "Smolfile line 1: 'memory' must be an integer number of MiB or a string like \"2G\", "
        'got boolean true; write memory = 2048 (MiB) or memory = "2G"',
    ),
    (
        "net-not-bool",
        'net = "yes"',
        "Smolfile line 1: 'net' must be true or false (no quotes), got string 'yes'",
    ),
    (
        "image-missing-dir",
        'image = "./nope"',
        "Smolfile line 1: 'image' rootfs directory '{base}/nope' does not exist; "
        "create it or fix the path (relative paths start at the Smolfile's directory)",
    ),
    (
        "image-dir-without-python",
        '\nimage = "./empty"',
        "Smolfile line 2: 'image' rootfs directory '{base}/empty' has no usr/bin/python3; "
        'install python3 in it, or use an image name like "debian:bookworm"',
    ),
    (
        "image-bad-name",
        'image = "my image"',
        "Smolfile line 1: 'image' 'my image' is neither an image name nor a path; use a name "
        'like "debian:bookworm" or "python:3.12-slim", or a rootfs directory starting with '
        "./, ../, / or ~",
    ),
    (
        "image-not-string",
        "image = 3",
        'Smolfile line 1: \'image\' must be a string like "debian:bookworm" or "./rootfs", '
        "got integer 3",
    ),
    (
        "allow-hosts-url",
        '[network]\nallow_hosts = [\n  "pypi.org",\n  "http://example.com/simple",\n]',
        "Smolfile line 4: [network] allow_hosts entry 'http://example.com/simple' is a URL, "
        'not a hostname; write just the host, like "example.com"',
    ),
    (
        "allow-hosts-empty",
        '[network]\nallow_hosts = [""]',
        f"Smolfile line 2: [network] allow_hosts entry '' is empty; {HOST_FIX}",
    ),
    (
        "allow-hosts-space",
        '[network]\nallow_hosts = ["pypi org"]',
        f"Smolfile line 2: [network] allow_hosts entry 'pypi org' contains whitespace; {HOST_FIX}",
    ),
    (
        "allow-hosts-bad-port",
        '[network]\nallow_hosts = ["pypi.org:0"]',
        "Smolfile line 2: [network] allow_hosts entry 'pypi.org:0' has an invalid port '0'; "
        "use a number from 1 to 65535",
    ),
    (
        "allow-hosts-bad-label",
        '[network]\nallow_hosts = ["pypi_.org"]',
        "Smolfile line 2: [network] allow_hosts entry 'pypi_.org' is not a valid hostname "
        "(bad label 'pypi_': use letters, digits and '-', not at either end); " + HOST_FIX,
    ),
    (
        "allow-hosts-not-array",
        '[network]\nallow_hosts = "pypi.org"',
        "Smolfile line 2: [network] 'allow_hosts' must be an array of strings, "
        "got string 'pypi.org'",
    ),
    (
        "allow-cidrs-bad",
        '[network]\nallow_hosts = []\nallow_cidrs = ["10.0.0.0/33"]',
        "Smolfile line 3: [network] allow_cidrs entry '10.0.0.0/33' is not an IP network; "
        'write an address or CIDR like "10.0.0.0/8" or "192.168.1.7", optionally with a port '
        'like "127.0.0.2/32:8080" ("[2001:db8::/32]:443" for IPv6)',
    ),
    (
        "allow-cidrs-bad-port",
        '[network]\nallow_cidrs = ["127.0.0.2/32:99999"]',
        "Smolfile line 2: [network] allow_cidrs entry '127.0.0.2/32:99999' has an invalid port '99999'; "
        "use a number from 1 to 65535",
    ),
    (
        "env-value-not-string",
        '[env]\nA = "1"\nB = 3',
        "Smolfile line 3: [env] value of 'B' must be a string, got integer 3; quote it: B = \"3\"",
    ),
    (
        "env-bad-name",
        'env = { "1X" = "a" }',
        "Smolfile line 1: [env] name '1X' is not a valid variable name; use letters, digits "
        "and _ (not starting with a digit)",
    ),
    (
        "workdir-relative",
        'workdir = "work"',
        "Smolfile line 1: 'workdir' must be an absolute path inside the machine, got 'work'; "
        "write '/work'",
    ),
    (
        "init-entry-not-string",
        "init = [1]",
        "Smolfile line 1: 'init' entry 1 must be a shell command string, got integer 1",
    ),
    (
        "volume-missing-host-dir",
        'cpus = 1\nvolumes = [{ host = "missing", guest = "/d" }]',
        "Smolfile line 2: volume 1 host directory '{base}/missing' does not exist; create it or "
        "fix 'host' (relative paths start at the Smolfile's directory)",
    ),
    (
        "volume-relative-guest",
        '[[volumes]]\nhost = "data"\nguest = "/d"\n\n[[volumes]]\nhost = "data"\nguest = "e"',
        "Smolfile line 7: volume 2 'guest' must be an absolute path inside the machine, "
        "got 'e'; write '/e'",
    ),
    (
        "volume-missing-guest",
        '[[volumes]]\nhost = "data"',
        "Smolfile line 1: volume 1 is missing 'guest' (an absolute path inside the machine)",
    ),
    (
        "volume-unknown-key",
        '[[volumes]]\nhost = "data"\nguest = "/d"\nro = true',
        "Smolfile line 4: unknown key 'ro' in volume 1; allowed keys: guest, host, readonly",
    ),
    (
        "volume-readonly-not-bool",
        'volumes = [{ host = "data", guest = "/d", readonly = "no" }]',
        "Smolfile line 1: volume 1 'readonly' must be true or false (no quotes), got string 'no'",
    ),
    (
        "branch-enabled-not-bool",
        "[branch]\nenabled = 1",
        "Smolfile line 2: [branch] 'enabled' must be true or false (no quotes), got integer 1",
    ),
    (
        "toml-syntax",
        "cpus = 2\nimage = debian:bookworm\n",
        "Smolfile line 2: TOML syntax error: Invalid value (column 9); fix the TOML syntax there "
        '(strings need quotes: image = "debian:bookworm")',
    ),
    (
        "cpus-more-than-host",
        "cpus = 9",
        "Smolfile line 1: 'cpus' is more than this host's 8 cores, got 9; write cpus = 8 or less",
    ),
    (
        "memory-more-than-host",
        'memory = "10000T"',
        "Smolfile line 1: 'memory' is more than this host's RAM (16384 MiB), got '10000T' "
        "(10485760000 MiB); write memory = 16384 or less",
    ),
    (
        "memory-int-more-than-host",
        "\nmemory = 16385",
        "Smolfile line 2: 'memory' is more than this host's RAM (16384 MiB), got 16385; "
        "write memory = 16384 or less",
    ),
    (
        "pids-too-few",
        "pids = 2",
        "Smolfile line 1: 'pids' must be from 16 to 32768 processes and threads, got 2; "
        "write pids = 16",
    ),
    (
        "pids-too-many",
        "pids = 1000000",
        "Smolfile line 1: 'pids' must be from 16 to 32768 processes and threads, got 1000000; "
        "write pids = 32768",
    ),
    (
        "pids-string",
        'pids = "64"',
        "Smolfile line 1: 'pids' must be a whole number of processes and threads, "
        "got string '64' (write pids = 64, without quotes)",
    ),
    (
        "disk-too-small",
        'disk = "1M"',
        "Smolfile line 1: 'disk' must be at least 16 MiB, got '1M' (1 MiB); write disk = 16 or more",
    ),
    (
        "disk-more-than-host",
        'disk = "1T"',
        "Smolfile line 1: 'disk' is more than this host's RAM (16384 MiB; the workspace and /tmp "
        "live in memory), got '1T' (1048576 MiB); write disk = 16384 or less",
    ),
    (
        "disk-bad",
        "disk = 1.5",
        "Smolfile line 1: 'disk' must be an integer number of MiB or a string like \"2G\", "
        'got float 1.5; write disk = 2048 (MiB) or disk = "2G"',
    ),
    (
        "init-timeout-zero",
        "init_timeout = 0",
        "Smolfile line 1: 'init_timeout' must be more than 0 and at most 86400 seconds, got 0; "
        "write init_timeout = 600",
    ),
    (
        "init-timeout-string",
        'init_timeout = "10m"',
        "Smolfile line 1: 'init_timeout' must be a number of seconds, got string '10m'; "
        "write init_timeout = 600",
    ),
    (
        "max-alive-zero",
        "max_alive = 0",
        "Smolfile line 1: 'max_alive' must be from 1 to 1024 kept machines, got 0; write max_alive = 1",
    ),
    (
        "toml-duplicate-key",
        "cpus = 2\n\ncpus = 3\n",
        "re:^Smolfile line 3: TOML syntax error: .+; fix the TOML syntax there$",
    ),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_smolfile(base: Path, text: str, expected: str) -> None:
    if expected.startswith("re:"):
        pattern = expected[3:]
    else:
        pattern = "^" + re.escape(expected.replace("{base}", str(base))) + "$"
    with pytest.raises(SmolfileError, match=pattern) as err:
        parse_smolfile(text, base_dir=str(base))
    assert "\n" not in str(err.value)


def test_cluster_table_says_where_machines_run_and_refuses_ray_client(tmp_path: Path) -> None:
    from smolbench.smolfile import load_cluster

    good = tmp_path / "Smolfile"
    good.write_text('[cluster]\naddress = "10.0.0.5:6379"\n')
    assert load_cluster(good) == {"address": "10.0.0.5:6379"}
    assert load_smolfile(good).baseline() == parse_smolfile("").baseline()  # where, not what: same baseline
    bad = tmp_path / "Client"
    bad.write_text('[cluster]\naddress = "ray://head:10001"\n')
    with pytest.raises(SmolfileError, match="Ray Client, which can't stream generators"):
        load_smolfile(bad)
    typo = tmp_path / "Typo"
    typo.write_text('[cluster]\nadress = "auto"\n')
    with pytest.raises(SmolfileError, match="unknown key 'adress' in \\[cluster\\]"):
        load_smolfile(typo)


def _hangs(call: object, fifo: Path) -> list[object]:
    """What ``call()`` returned or raised, run in a thread; a fail if it waited on ``fifo`` (the old
    code: the stuck open is let go by a writer coming and going first, so the suite never hangs)."""
    import threading

    got: list[object] = []

    def run() -> None:
        try:
            got.append(call())  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(5)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail("reading the Smolfile waited on a fifo")
    return got


def test_a_smolfile_is_read_as_a_plain_file_of_bounded_size(base: Path) -> None:
    """Audit: the Smolfile was read by path, blocking and whole: a fifo there hung ``Session()`` and
    ``%smol up``, and one that is a link to /dev/zero grew memory without bound. Now the path is
    resolved (a link the user made to a Smolfile keeps working) and the real file read as a plain
    file only, at most 1 MiB of it, or refused in one line."""
    import subprocess
    import sys

    from smolbench._smolfilewatch import SmolfileWatch
    from smolbench.smolfile import load_cluster

    fifo = base / "Smolfile"
    os.mkfifo(fifo)
    plain = "not a plain file (a fifo, a device or a folder); point at a Smolfile that is a regular file"
    for call in (lambda: load_smolfile(fifo), lambda: load_cluster(fifo)):
        [err] = _hangs(call, fifo)
        assert isinstance(err, SmolfileError) and str(err) == f"{fifo}: {plain}", err

    fifo.unlink()
    fifo.write_text("cpus = 2\n")
    watch = SmolfileWatch(fifo, load_smolfile(fifo))
    fifo.unlink()
    os.mkfifo(fifo)
    [line] = _hangs(watch.news, fifo)
    assert isinstance(line, str) and "can't be read now (not a plain file" in line, line

    big = base / "big"
    big.write_text("cpus = 2\n" + "#" * (1 << 20) + "\n")
    with pytest.raises(SmolfileError, match=r"big: larger than 1 MiB, too big to be a Smolfile; point at the right "):
        load_smolfile(big)

    mine = base / "mine" / "Smolfile"  # the user's own link to a Smolfile elsewhere: followed
    mine.parent.mkdir()
    mine.symlink_to(base / "real.toml")
    (base / "real.toml").write_text('image = "./rootfs"\ncpus = 3\n')
    spec = load_smolfile(mine)
    assert spec.cpus == 3 and spec.image == str(base / "rootfs")  # relative to the real file's folder

    zero = base / "zero"  # in a child with 1 GiB of address space: the old read grew until it ran out
    zero.symlink_to("/dev/zero")
    code = ("import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
            "from smolbench.errors import SmolfileError\nfrom smolbench.smolfile import load_smolfile\n"
            "try:\n    load_smolfile(sys.argv[1])\nexcept SmolfileError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code, str(zero)], capture_output=True, text=True, timeout=60)
    assert done.stdout == f"{zero}: {plain}\n", (done.stdout, done.stderr[-500:])
