#!/usr/bin/env bash
# The control for recheck.sh: run every test selection INDEX.tsv names on the code as it is (no plant), one pytest
# call per test file with its selections OR-ed, so a CAUGHT in recheck.sh means the plant made the failure.
#   bash docs/audit/plants/clean.sh WORKTREE [OUT.tsv]
# One line per file: file, result (PASS / FAIL / NO-TESTS / ERROR), pytest's summary line, seconds.
set -u
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TREE="$(cd "${1:?usage: clean.sh WORKTREE [OUT.tsv]}" && pwd)"
OUT="${2:-$KIT/clean-$(date +%Y%m%d-%H%M%S).tsv}"
PYTHON="${PYTHON:-$TREE/.venv/bin/python}"
export OMP_NUM_THREADS=1
printf 'file\tresult\tsummary\tseconds\n' > "$OUT"
"$PYTHON" - "$KIT/INDEX.tsv" > "$OUT.plan" <<'EOF'
import shlex, sys
by_file = {}
for line in open(sys.argv[1]).read().splitlines()[1:]:
    for group in line.split("\t")[3].split(";"):
        args = shlex.split(group)
        path, k = args[0], (args[args.index("-k") + 1] if "-k" in args else None)
        by_file.setdefault(path, set()).add(k)
for path, ks in sorted(by_file.items()):
    expr = "" if None in ks else " or ".join(f"({k})" for k in sorted(ks))
    print(f"{path}\t{expr}")
EOF
while IFS=$'\t' read -r path expr; do
    start=$SECONDS
    if [ -n "$expr" ]; then set -- "$path" -k "$expr"; else set -- "$path"; fi
    summary="$(cd "$TREE" && "$PYTHON" -m pytest -q -p no:randomly -p no:cacheprovider "$@" < /dev/null 2>&1 | tail -1)"
    if [[ "$summary" =~ failed|error ]]; then result=FAIL
    elif [[ "$summary" =~ [0-9]+\ passed ]]; then result=PASS
    else result=NO-TESTS; fi
    printf '%s\t%s\t%s\t%s\n' "$path" "$result" "$summary" "$((SECONDS - start))" >> "$OUT"
    echo "$path $result $summary"
done < "$OUT.plan"
rm -f "$OUT.plan"
echo "results: $OUT"
