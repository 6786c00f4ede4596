#!/usr/bin/env bash
# Install everything fedmech-flwr needs into ./.venv, plus the Fashion-MNIST data.
# Idempotent: a second run only checks. Needs Python 3.11 (torch 2.14.1 wheels).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
  echo "error: Python 3.11 is required (torch==2.14.1 is pinned); found $("$PYTHON" --version)" >&2
  exit 1
}

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[test,docs]'

# openssl and ssh-keygen make the TLS certificates and SuperNode keys (scripts/make_certs.sh).
if ! command -v openssl >/dev/null || ! command -v ssh-keygen >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq openssl openssh-client >/dev/null
  else
    echo "note: fedmech deploy-local --tls/--auth needs openssl and ssh-keygen" \
         "('sudo apt-get install openssl openssh-client')." >&2
  fi
fi

# Chromium: the report test opens index.html in it, headless, through playwright (never `playwright install`).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
  else
    echo "note: the browser test of fedmech report needs /usr/bin/chromium" \
         "('sudo apt-get install chromium'); without it that test is skipped." >&2
  fi
fi

FMNIST=/usr/share/datasets/fashion-mnist
if [ ! -f "$FMNIST/train-images-idx3-ubyte.gz" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "note: Fashion-MNIST is not in $FMNIST. Install it with" \
         "'sudo apt-get install dataset-fashion-mnist' (Debian/Ubuntu), or set data.dataset.root" \
         "to a folder with the four idx .gz files." >&2
  fi
fi
echo "setup done: $(.venv/bin/python -c 'import flwr, torch; print("flwr", flwr.__version__, "torch", torch.__version__)')"
