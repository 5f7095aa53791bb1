#!/usr/bin/env bash
# Makes git ignore the carried parts' folders (.devA, .devG*, .devV*, .devR, .devq) in this clone, through its
# .git/info/exclude: the device tool carries every file git does not ignore, so an unignored part would travel with
# every call and overflow the 64 MiB a call takes. The product's .gitignore does not name them; a new clone lacks
# the rule until lab/device_carry.sh or lab/carry_vllm.sh builds a part (each runs this first). Outside a git
# checkout (the device's copy of the tree): nothing to do.
set -euo pipefail
exclude="$(git rev-parse --git-common-dir 2>/dev/null)/info/exclude" || exit 0
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
for pattern in '/.devA/' '/.devG*/' '/.devV*/' '/.devR/' '/.devq/'; do
  grep -qxF "$pattern" "$exclude" || echo "$pattern" >> "$exclude"
done
