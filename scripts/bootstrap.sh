#!/usr/bin/env bash
# Create the virtualenv and install Orrery with its development tools.
# On a fresh Debian, `python3 -m venv` needs the python3-venv package: install it when we can.
set -euo pipefail
venv=${1:-.venv}

python=""
for candidate in python3.11 python3.12 python3.13 python3; do
  if command -v "$candidate" >/dev/null 2>&1 &&
     "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
    python=$candidate; break
  fi
done
if [ -z "$python" ]; then
  echo "Orrery needs Python 3.11 or newer (apt-get install python3)." >&2
  exit 1
fi

if ! "$python" -m venv "$venv" 2>/dev/null; then
  rm -rf "$venv"
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "Installing python3-venv with apt-get…"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  elif command -v sudo >/dev/null && command -v apt-get >/dev/null; then
    sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
  else
    echo "'$python -m venv' failed; install your distribution's venv package." >&2
    exit 1
  fi
  "$python" -m venv "$venv"
fi

"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
echo "Installed Orrery into $venv"
