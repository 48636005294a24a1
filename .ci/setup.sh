# Sourced by .ci/run and scripts/demo: system packages, then the project in ./.venv.
# Works as root (containers, CI: no sudo needed) and as a user (sudo for apt-get only).
# usage: . .ci/setup.sh EXTRAS APT_PACKAGE...
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"
  elif command -v sudo >/dev/null 2>&1; then sudo "$@"
  else echo "smolbench setup: '$*' needs root: run this as root or install sudo" >&2; return 1
  fi
}

smol_setup() {
  local extras=$1; shift
  local missing=()
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg"); done
  if [ ${#missing[@]} -gt 0 ]; then
    as_root apt-get update -qq
    as_root apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  # A venv inside the checkout: the same on a laptop, in a container as root, and in CI.
  if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # The distribution was once called smolbench (a name the index gives to another project).
  if .venv/bin/python -m pip show -q smolbench >/dev/null 2>&1; then .venv/bin/python -m pip uninstall -q -y smolbench; fi
  .venv/bin/python -m pip install -q -e ".[$extras]"
  export PATH="$PWD/.venv/bin:$PATH" VIRTUAL_ENV="$PWD/.venv"
}
