# Sourced by the other scripts: sets PY, the Python that Rampwatch is installed into and run with.
#   $PYTHON if given, else the active virtual environment's, else the project's .venv (made here;
#   on Debian/Ubuntu, whose python3 has no venv module by default, after installing python3-venv).
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY="$VIRTUAL_ENV/bin/python"
else
  if [ ! -x .venv/bin/python ]; then
    if ! python3 -m venv .venv >/dev/null 2>&1; then
      rm -rf .venv
      echo "setup: python3 has no working venv module; installing python3-venv" >&2
      SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
      $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
      python3 -m venv .venv
    fi
  fi
  PY="$PWD/.venv/bin/python"
fi
export PATH="$(dirname "$PY"):$PATH"  # so `rampwatch` and `streamlit` are the ones installed here
