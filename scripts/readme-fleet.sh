#!/usr/bin/env bash
# Runs the README's "A secured fleet by hand" commands verbatim, as a new operator would paste
# them, and checks what they did: the refit committed on both workers, the reader's status shows
# both admitted on step-1, the journal holds the committed refit, and every process ended.
#
#   scripts/readme-fleet.sh      (after the release build of mx and mx-lab, and the models)
#
# The block is the first ```sh fence after the heading "### 2. A secured fleet by hand" in
# README.md, run from the checkout by bash as a reader's shell runs what they paste (no -e:
# what each step did is checked below instead) with a 10-minute limit. Its output is in $MX_README_LOG (default
# /tmp/mx-readme-fleet.log). Exit status 0 only when every check holds.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
LOG="${MX_README_LOG:-/tmp/mx-readme-fleet.log}"
cd "$REPO"

block="$(awk '
    /^### 2\. A secured fleet by hand/ { in_section = 1; next }
    in_section && /^```sh$/ { in_block = 1; next }
    in_block && /^```$/ { exit }
    in_block { print }
' README.md)"
if [[ -z "$block" ]]; then
    echo "readme-fleet: no sh block under \"### 2. A secured fleet by hand\" in README.md" >&2
    exit 2
fi
for bin in mx mx-lab; do
    if [[ ! -x "target/release/$bin" ]]; then
        echo "readme-fleet: no target/release/$bin (cargo build --release --bin mx --bin mx-lab)" >&2
        exit 2
    fi
done

# The block runs in a session of its own, so whatever it leaves running is found (and stopped).
pgid_file="$(mktemp)"
set +e
timeout --kill-after=10 600 setsid bash -c 'echo $$ >"$0"; exec bash -c "$1"' "$pgid_file" "$block" >"$LOG" 2>&1
rc=$?
set -e
pgid="$(cat "$pgid_file")"
rm -f "$pgid_file"
left() { pgrep -g "$pgid" >/dev/null 2>&1; }
for _ in $(seq 50); do left || break; sleep 0.1; done
leftover=0
if left; then
    leftover=1
    pkill -KILL -g "$pgid" 2>/dev/null || true
fi

fail() {
    echo "readme-fleet: $1 (the block's output: $LOG)" >&2
    tail -n 40 "$LOG" >&2
    exit 1
}
((rc == 0)) || fail "the README's commands exited $rc"
if grep -Ei "command not found|no such job|no such file|^error|usage:" "$LOG" >&2; then
    fail "a README command failed (above)"
fi
grep -Eq "^refit 1 -> step-1 \(mx:[0-9a-f]{12}\): COMMITTED" "$LOG" || fail "step 7's refit did not say 'refit 1 -> step-1 (mx:...): COMMITTED'"
grep -Eq "^  w[01] .* \[7042, 30, 198, 198\]$" "$LOG" || fail "step 7's check did not show the golden tokens ' Paris.\n\n'"
# Step 8: the reader's status, both workers resident on step-1 and admitted.
for w in w0 w1; do
    grep -Eq "^$w +tp:3 +0-2 +connected +step-1 +.* admitted$" "$LOG" ||
        fail "step 8's status does not show $w connected, resident step-1 and admitted"
done
# Step 9: the journal's account of the refit.
grep -q "journal: complete" "$LOG" || fail "step 9's journal is not complete"
((leftover == 0)) || fail "processes of the fleet were still running 5 s after step 10"
echo "readme-fleet: the README's secured fleet came up, refitted step-1 on w0 and w1, and stopped cleanly"
