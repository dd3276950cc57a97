#!/usr/bin/env bash
# pytest on another source tree's cula and tests: a folder holding cula/ and tests/, for instance
# `mkdir -p dev_trees/x && git archive <rev> cula tests | tar -x -C dev_trees/x`. It runs from inside the tree:
# `python -m pytest` puts the working directory first on sys.path, so run from here it would import this
# checkout's cula instead (and say nothing about the tree). The tree's tests read this checkout's pytest settings.
#   bash tools/tree_tests.sh TREE [pytest args...]      e.g. bash tools/tree_tests.sh dev_trees/x -m gpu -q
set -euo pipefail
tree=$(cd "${1:?usage: tools/tree_tests.sh TREE [pytest args...]}" && pwd)
shift
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$tree"
export PYTHONPATH="$tree:$root${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import cula, sys; sys.exit(0 if cula.__file__.startswith('$tree/') else 'imported ' + cula.__file__)"
exec python3 -m pytest -c "$root/pyproject.toml" --rootdir "$tree" "$@"
