#!/usr/bin/env bash
# Regenerate constraints.txt, the one tested environment: every dependency of the project and its extras,
# resolved for every platform from Python 3.10 on, with the GPU image's versions (requirements/gpu-image.txt)
# pinned. Needs uv (https://docs.astral.sh/uv/) and PyPI. See docs/install.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=(uv pip compile pyproject.toml --extra test --extra bonus --extra lowbit --extra bf16 --extra notebook --extra timm
  --universal --python-version 3.10 -c requirements/gpu-image.txt --no-header)
{
  echo "# The tested environment: pip install -c constraints.txt -e \".[test]\" (docs/install.md)."
  echo "# Pins the GPU image's versions that the committed results came from (requirements/gpu-image.txt)."
  echo "# Regenerate with scripts/lock.sh; it writes this header, then the output of (uv $(uv --version | cut -d' ' -f2)):"
  echo "#   ${cmd[*]}"
  "${cmd[@]}" --quiet
} >constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
