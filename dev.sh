#!/usr/bin/env bash
# One entry point for people and CI: ./dev.sh run | test | lint | bench | stubs | setup | system-test | libvirt-check
#   run    set up, then run the end-to-end demo on a simulated node (no cluster, no GPU)
#   test   set up, then run the test suite
#   lint   set up, then ruff (lint + format check) and mypy
#   bench  set up, then run every benchmark in bench/
#   stubs  set up, then regenerate the gRPC stubs from proto/
#   system-test  set up, then (as root) boot a real iommufd kernel under QEMU and run the whole path
#   libvirt-check  set up, then (as root) check the hook's golden outputs with a real libvirt 12.9
# Setup installs what is missing and nothing else: Debian packages (as root, with apt-get) that
# the Python dependencies need to build or run, then a virtualenv in .venv with the project and
# its dev tools. It is quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv

log() { printf '==> %s\n' "$*" >&2; }

system_packages() {
    # libvirt-python builds against libvirt's headers and finds them with pkg-config; pci.ids
    # gives device names.
    local wanted=(libvirt-dev pkg-config pci.ids gcc libc6-dev)
    # Debian's own python3 ships venv/ensurepip and its C headers as separate packages.
    if ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then wanted+=(python3-venv); fi
    if ! "$PYTHON" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
        wanted+=(python3-dev)
    fi
    local missing=()
    for package in "${wanted[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$package")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        log "missing Debian packages: ${missing[*]} - install them as root (apt-get install ${missing[*]})"
        exit 1
    fi
    log "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

python_env() {
    local stamp="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
    [ -f "$stamp" ] && return 0
    log "creating $VENV and installing kubevirt-iommufd with its dev tools"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e '.[dev]'
    rm -f "$VENV"/.installed-*
    touch "$stamp"
}

setup() {
    system_packages
    python_env
}

command=${1:-}
shift || true
case "$command" in
    setup) setup ;;
    run)
        setup
        exec "$VENV/bin/kubevirt-iommufd" demo "$@"
        ;;
    test)
        setup
        exec "$VENV/bin/python" -m pytest "$@"
        ;;
    lint)
        setup
        "$VENV/bin/ruff" check .
        "$VENV/bin/ruff" format --check .
        "$VENV/bin/mypy"
        ;;
    bench)
        setup
        # As modules from the repository root: a bench may import another's helpers (bench.webhook).
        for script in bench/*.py; do
            case "$(basename "$script")" in __init__.py | benchkit.py) continue ;; esac
            log "$script"
            "$VENV/bin/python" -m "bench.$(basename "$script" .py)"
        done
        ;;
    stubs)
        setup
        exec "$VENV/bin/python" proto/generate.py "$@"
        ;;
    system-test)
        setup
        exec "$VENV/bin/python" tests/system/run.py "$@"
        ;;
    libvirt-check)
        setup
        exec "$VENV/bin/python" tests/system/libvirt12.py "$@"
        ;;
    *)
        sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
        [ -z "$command" ] || exit 2
        ;;
esac
