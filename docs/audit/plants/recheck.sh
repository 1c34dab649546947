#!/usr/bin/env bash
# Re-check the planted bugs against a worktree: apply each patch alone, run the pytest arguments INDEX.tsv lists
# for it (one pytest call per ';'-separated group, stopping at the first group that fails), record the result,
# revert the patched files. Nothing is committed.
#
#   bash docs/audit/plants/recheck.sh WORKTREE [OUT.tsv] [ID ...]
#
# Results (one line per plant: id, result, detail, seconds):
#   CAUGHT        a test failed (detail: the first FAILED line)
#   CAUGHT-ERROR  pytest stopped on an error (collection/import error: the plant breaks the module outright)
#   ESCAPED       every listed test passed with the plant in (a real gap, or a stale test list)
#   NO-APPLY      the patch does not apply (the code moved: re-plant by hand from INDEX.tsv's "where")
#   NO-TESTS      a listed test file or -k selection found nothing (tests renamed/moved: update INDEX.tsv)
#   TIMEOUT       a group ran past PLANT_TIMEOUT seconds (default 900)
#   DIRTY         a file the patch touches has uncommitted changes: skipped, nothing touched
# Env: PYTHON (default WORKTREE/.venv/bin/python), PLANT_TIMEOUT, FILES_ONLY=1 (drop -k selections: run whole files).
# Always OMP_NUM_THREADS=1, -x -q, -p no:randomly, no xdist. Reverts with `git checkout --` on the patched files
# only, also on failure or Ctrl-C.
set -u
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TREE="$(cd "${1:?usage: recheck.sh WORKTREE [OUT.tsv] [ID ...]}" && pwd)"
OUT="${2:-$KIT/recheck-$(date +%Y%m%d-%H%M%S).tsv}"
shift $(( $# >= 2 ? 2 : 1 ))
WANT=("$@")
PYTHON="${PYTHON:-$TREE/.venv/bin/python}"
LIMIT="${PLANT_TIMEOUT:-900}"
export OMP_NUM_THREADS=1
LOGDIR="$(mktemp -d /tmp/plants-recheck.XXXXXX)"
TOUCHED=()

revert() {
    if ((${#TOUCHED[@]})); then
        git -C "$TREE" checkout -- "${TOUCHED[@]}" 2>/dev/null
        TOUCHED=()
    fi
}
trap 'revert' EXIT
trap 'revert; exit 130' INT TERM

[ -s "$OUT" ] || printf 'id\tresult\tdetail\tseconds\n' > "$OUT"

while IFS=$'\t' read -r id desc where tests; do
    [ "$id" = "id" ] && continue
    if ((${#WANT[@]})) && [[ ! " ${WANT[*]} " =~ " $id " ]]; then continue; fi
    patch="$KIT/$id.patch"
    start=$SECONDS
    if [ ! -s "$patch" ]; then
        printf '%s\tNO-APPLY\tno patch file\t0\n' "$id" >> "$OUT"; continue
    fi
    mapfile -t files < <(git -C "$TREE" apply --numstat "$patch" 2>/dev/null | cut -f3)
    if ((${#files[@]} == 0)) || ! git -C "$TREE" apply --check "$patch" 2>/dev/null; then
        printf '%s\tNO-APPLY\t%s\t0\n' "$id" "$(git -C "$TREE" apply --check "$patch" 2>&1 | head -1)" >> "$OUT"
        echo "$id NO-APPLY"; continue
    fi
    if ! git -C "$TREE" diff --quiet -- "${files[@]}"; then
        printf '%s\tDIRTY\tuncommitted changes in %s\t0\n' "$id" "${files[*]}" >> "$OUT"
        echo "$id DIRTY"; continue
    fi
    TOUCHED=("${files[@]}")
    git -C "$TREE" apply "$patch"
    result=ESCAPED detail="" log="$LOGDIR/$id.log"
    IFS=';' read -ra groups <<< "$tests"
    for group in "${groups[@]}"; do
        if [ "${FILES_ONLY:-0}" = 1 ]; then group="$(sed -E "s/ -k ('[^']*'|[^ ]+)//; s/::[^ ]+//g" <<< "$group")"; fi
        eval "set -- $group"
        (cd "$TREE" && timeout "$LIMIT" "$PYTHON" -m pytest -x -q -p no:randomly -p no:cacheprovider "$@" < /dev/null) \
            > "$log" 2>&1
        rc=$?
        case $rc in
            0) continue ;;
            1) result=CAUGHT
               detail="$(grep -m1 -E '^(FAILED|ERROR) ' "$log" | cut -c1-200)" ;;
            2|3) result=CAUGHT-ERROR
               detail="$(grep -m1 -E '^(E |ERROR )' "$log" | cut -c1-200)" ;;
            4|5) result=NO-TESTS; detail="rc=$rc: $group" ;;
            124|137) result=TIMEOUT; detail="$group" ;;
            *) result=CAUGHT-ERROR; detail="rc=$rc" ;;
        esac
        [ "$result" = NO-TESTS ] && continue  # a later group may still select tests
        break
    done
    revert
    printf '%s\t%s\t%s\t%s\n' "$id" "$result" "${detail//$'\t'/ }" "$((SECONDS - start))" >> "$OUT"
    echo "$id $result ${detail:0:120}"
done < "$KIT/INDEX.tsv"
echo "results: $OUT (logs: $LOGDIR)"
